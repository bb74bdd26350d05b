"""Per-step log-probabilities against transformers' logits, and OpenAI penalties against a plain re-implementation."""

from __future__ import annotations

import asyncio

import pytest
import torch

from llm.engine import sample
from schemas import GenerateRequest, SamplingParams
from tests.llm.reference import collect, make_engine, reference_generate, request_for


def test_per_step_logprobs_match_transformers_in_a_mixed_batch(checkpoint, reference, model, vision):
    requests = [
        request_for(
            checkpoint, reference, vision, sizes, seed=i, prefix=list(range(3, 6 + i)), logprobs=True, top_logprobs=5
        )
        for i, sizes in enumerate([[], [(64, 48)], [(28, 90)]])
    ]
    engine = make_engine(model, reference, max_num_batched_tokens=9, block_size=4, num_blocks=256)

    async def together():
        async def one(inp):
            lps = []
            async for chunk in engine.generate(inp):
                lps += chunk.logprobs
            return lps

        return await asyncio.gather(*(one(inp) for inp, _ in requests))

    for (_, ref), lps in zip(requests, asyncio.run(together()), strict=True):
        out = reference_generate(reference, ref, 12, output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, ref["input_ids"].shape[1] :].tolist()
        assert len(lps) == len(tokens) == len(out.logits)
        for token, lp, logits in zip(tokens, lps, out.logits, strict=True):
            ref_lp = torch.log_softmax(logits[0].float(), -1)
            assert lp.logprob == pytest.approx(float(ref_lp[token]), rel=1e-4, abs=2e-4)
            top = ref_lp.topk(5)
            assert [i for i, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), rel=1e-4, abs=2e-4)


def _penalized_greedy(reference, ids: list[int], steps: int, presence: float, frequency: float) -> list[int]:
    """OpenAI's penalties the plain way: recompute everything each step, subtract, take the best."""
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([ids + out])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
        logits -= presence * (counts > 0) + frequency * counts
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 0.7), (-0.5, 0.3)])
def test_penalties_match_a_plain_reimplementation(reference, model, presence, frequency):
    engine = make_engine(model, reference)
    inp = GenerateRequest(
        "p",
        [5, 6, 7],
        [],
        [],
        SamplingParams(
            max_tokens=16, temperature=0.0, presence_penalty=presence, frequency_penalty=frequency, ignore_eos=True
        ),
    )
    ours, _ = asyncio.run(collect(engine, inp))
    assert ours == _penalized_greedy(reference, [5, 6, 7], 16, presence, frequency)


def test_sampling_rows_use_their_own_settings():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=1, temperature=1.0, top_k=1),
        SamplingParams(max_tokens=1, temperature=2.0, top_p=1e-9),
        SamplingParams(max_tokens=1, temperature=0.7),
    ]
    gens = [None] + [torch.Generator().manual_seed(i) for i in range(3)]
    tokens, lps = sample(logits.clone(), params, gens, [None] * 4)
    best = logits.argmax(-1).tolist()
    assert tokens[:3] == best[:3] and lps == [None] * 4
    draws = {
        sample(logits[3:].clone(), params[3:], [torch.Generator().manual_seed(s)], [None])[0][0] for s in range(40)
    }
    assert len(draws) > 3  # the free row really samples
