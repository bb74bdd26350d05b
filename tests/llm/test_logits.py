"""The logits processors (llm/engine/sampling.py) against transformers' own on the same logits, rows with different
settings in one batch: repetition penalty, min_p, min_tokens, logit_bias, and their order."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from llm.engine import sample
from llm.engine.sampling import RowState, apply_before_temperature, apply_min_p
from schemas import SamplingParams
from tests.llm.reference import states_for

V = 96
EOS = frozenset({90, 91})


def _logits(B: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 4  # (B, V), both signs


def _states(params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]) -> list[RowState]:
    """Each row's state after its prompt and the tokens it generated so far."""
    states = [RowState.start(p, pr, EOS, V, torch.device("cpu")) for p, pr in zip(params, prompts, strict=True)]
    for state, out in zip(states, outputs, strict=True):
        for t in out:
            state.add(t)
    return states


def _hf(processors, ids: list[int], row: torch.Tensor) -> torch.Tensor:
    """transformers' processors on one row, given that row's input ids (prompt + output)."""
    return LogitsProcessorList(processors)(torch.tensor([ids]), row[None].clone())[0]


def test_repetition_penalty_equals_transformers_per_row():
    penalties = [1.0, 1.3, 0.7, 2.0]
    prompts = [[1, 2, 3], [4, 5, 5, 6], [7, 8], [1, 9, 10, 11]]
    outputs = [[3, 12], [13, 13, 4], [], [20, 1, 21]]
    params = [SamplingParams(8, repetition_penalty=p) for p in penalties]
    logits = _logits(4)
    ours = logits.clone()
    apply_before_temperature(ours, params, _states(params, prompts, outputs), [True] * 4)
    for i, p in enumerate(penalties):
        ref = _hf([RepetitionPenaltyLogitsProcessor(p)], prompts[i] + outputs[i], logits[i])
        torch.testing.assert_close(ours[i], ref, rtol=0, atol=0)
    assert not torch.equal(ours[1], logits[1]) and torch.equal(ours[0], logits[0])  # not vacuous; row 0 is off


def test_min_p_equals_transformers_per_row():
    min_ps = [0.0, 0.05, 0.3, 1.0]
    x = _logits(4, seed=1) / 4.0  # scaled by a temperature, as the sampler does first
    ours = apply_min_p(x, torch.tensor(min_ps))
    for i, m in enumerate(min_ps):
        ref = MinPLogitsWarper(m)(torch.tensor([[0]]), x[i][None].clone())[0]
        torch.testing.assert_close(ours[i], ref, rtol=0, atol=0)
    kept = [int(torch.isfinite(r).sum()) for r in ours]
    assert kept[0] == V and kept[3] == 1 and V > kept[1] > kept[2] > 1  # each row its own threshold


def test_min_tokens_equals_transformers_per_row():
    min_tokens = [0, 3, 3, 5]
    outputs = [[], [4, 5], [4, 5, 6], [7]]  # row 1 is still short, row 2 has its 3
    params = [SamplingParams(8, min_tokens=m) for m in min_tokens]
    logits = _logits(4, seed=2)
    ours = logits.clone()
    apply_before_temperature(ours, params, _states(params, [[1, 2]] * 4, outputs), [True] * 4)
    for i, m in enumerate(min_tokens):
        ref = _hf([MinNewTokensLengthLogitsProcessor(2, m, sorted(EOS))], [1, 2] + outputs[i], logits[i])
        torch.testing.assert_close(ours[i], ref, rtol=0, atol=0)
    assert torch.isinf(ours[1, sorted(EOS)]).all() and torch.isinf(ours[3, sorted(EOS)]).all()


def test_min_tokens_masks_the_requests_stop_token_ids_too_and_not_ignored_eos():
    params = [SamplingParams(8, min_tokens=2)]
    state = RowState.start(params[0], [1], frozenset({17}), V, torch.device("cpu"))  # EOS ignored: 17 alone
    logits = _logits(1, seed=3)
    ours = logits.clone()
    apply_before_temperature(ours, params, [state], [True])
    assert torch.isinf(ours[0, 17]) and torch.equal(ours[0, sorted(EOS)], logits[0, sorted(EOS)])


def test_logit_bias_equals_transformers_sequence_bias_per_row():
    biases = [{}, {3: 100.0, 40: -100.0}, {3: -2.5, 7: 1.25}]
    params = [SamplingParams(8, logit_bias=b) for b in biases]
    logits = _logits(3, seed=4)
    ours = logits.clone()
    apply_before_temperature(ours, params, _states(params, [[1]] * 3, [[]] * 3), [True] * 3)
    for i, b in enumerate(biases):
        ref = _hf([SequenceBiasLogitsProcessor([[[t], v] for t, v in b.items()])], [1], logits[i]) if b else logits[i]
        torch.testing.assert_close(ours[i], ref, rtol=0, atol=0)
    assert int(ours[1].argmax()) == 3


def test_the_order_is_bias_and_min_tokens_then_repetition_then_openai_penalties():
    """vLLM's order: logit_bias first (a biased seen token is then penalised), the penalties after."""
    p = SamplingParams(8, logit_bias={5: 3.0, 6: -3.0}, repetition_penalty=1.5, frequency_penalty=0.5,
                       presence_penalty=0.25, min_tokens=4)  # fmt: skip
    prompt, out = [5, 6, 8], [8, 9, 9]
    logits = _logits(1, seed=5)
    ours = logits.clone()
    apply_before_temperature(ours, [p], _states([p], [prompt], [out]), [True])
    ref = _hf(
        [
            SequenceBiasLogitsProcessor([[[5], 3.0], [[6], -3.0]]),
            MinNewTokensLengthLogitsProcessor(len(prompt), 4, sorted(EOS)),
            RepetitionPenaltyLogitsProcessor(1.5),
        ],
        prompt + out,
        logits[0],
    )
    counts = torch.bincount(torch.tensor(out), minlength=V).float()
    ref -= 0.5 * counts + 0.25 * (counts > 0)
    torch.testing.assert_close(ours[0], ref)


def test_a_grammar_row_is_not_held_by_min_tokens():
    """A grammar that may only end (its row allows EOS alone) would leave nothing to sample under min_tokens: the
    grammar decides there, and a free row beside it still waits."""
    params = [SamplingParams(8, min_tokens=5, temperature=0.0), SamplingParams(8, min_tokens=5, temperature=0.0)]
    logits = _logits(2, seed=6)
    logits[:, 90] = 50.0  # EOS is both rows' best
    bitmask = torch.zeros(2, (V + 31) // 32, dtype=torch.int32)
    bitmask[0, 90 // 32] = 1 << (90 % 32)  # row 0's grammar allows EOS alone
    tokens, _ = sample(logits, params, [None, None], _states(params, [[1]] * 2, [[]] * 2), (bitmask, [0]))
    assert tokens[0] == 90 and tokens[1] not in EOS


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sample_honours_the_bias_whatever_the_temperature(temperature):
    params = [SamplingParams(8, temperature=temperature, seed=0, logit_bias={33: 100.0}) for _ in range(3)]
    gens = [torch.Generator().manual_seed(i) if temperature else None for i in range(3)]
    tokens, _ = sample(_logits(3, seed=7), params, gens, states_for(params, V))
    assert tokens == [33, 33, 33]


def test_min_tokens_leaves_stop_ids_outside_the_logits_alone():
    """stop_token_ids the request may send (-1, past the vocabulary) are no tokens: a negative index must not wrap
    around to mask the last one."""
    params = [SamplingParams(8, min_tokens=2)]
    state = RowState.start(params[0], [1], frozenset({-1, 17, V + 5}), V, torch.device("cpu"))
    logits = _logits(1, seed=8)
    ours = logits.clone()
    apply_before_temperature(ours, params, [state], [True])
    assert torch.isinf(ours[0, 17]) and int(torch.isinf(ours).sum()) == 1
