"""Per-step and prompt log-probabilities against transformers' logits, and OpenAI penalties against a plain
re-implementation."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from llm.engine import sample
from schemas import GenerateRequest, SamplingParams
from tests.llm.reference import collect, make_engine, reference_generate, request_for, states_for


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
            async for chunk in engine.generate(inp.request, inp.embeds):
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


def _reference_prompt_logprobs(reference, ref: dict) -> torch.Tensor:
    """transformers' log-softmax over the prompt's rows: row i is the distribution of token i + 1. (P, V)"""
    ids = ref["input_ids"]
    extra = {k: v for k, v in ref.items() if k != "input_ids"}
    with torch.no_grad():
        mm = (ids == reference.config.image_token_id).int()
        logits = reference(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm, **extra).logits
    return torch.log_softmax(logits[0].float(), -1)


def test_prompt_logprobs_match_transformers_through_chunks_and_a_warm_prefix_cache(
    checkpoint, reference, model, vision
):
    """vLLM's prompt_logprobs: each prompt token's logprob given those before it, with the top k, on the first
    chunk; computed in a 9-token budget (chunks that cut an image) beside a free sequence, and again once the
    prompt's blocks are cached (its prefill must not reuse them: their logits were never kept)."""
    text, _ = request_for(checkpoint, reference, vision, [], seed=0, prefix=list(range(3, 30)))
    image, ref = request_for(
        checkpoint, reference, vision, [(64, 48)], seed=1, prefix=list(range(3, 9)), prompt_logprobs=4, max_tokens=3
    )
    engine = make_engine(model, reference, max_num_batched_tokens=9, block_size=4, num_blocks=256)

    async def run(inp):
        chunks = [chunk async for chunk in engine.generate(inp.request, inp.embeds)]
        assert all(c.prompt_logprobs is None for c in chunks[1:])
        return chunks[0].prompt_logprobs, [t for c in chunks for t in c.token_ids], chunks[0].num_cached_tokens

    async def together():
        return await asyncio.gather(run(image), collect(engine, text))

    (cold, tokens, _), _ = asyncio.run(together())
    warm, again, cached = asyncio.run(run(image))
    assert again == tokens and cached == 0  # its blocks are cached (below), yet this prompt recomputed them
    ref_lp = _reference_prompt_logprobs(reference, ref)
    ids = image.request.prompt_token_ids
    assert len(cold) == len(warm) == len(ids) - 1
    for i, (lp, lp_warm) in enumerate(zip(cold, warm, strict=True)):
        assert lp.logprob == pytest.approx(float(ref_lp[i, ids[i + 1]]), rel=1e-4, abs=2e-4), i
        top = ref_lp[i].topk(4)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), rel=1e-4, abs=2e-4)
        assert lp_warm.logprob == pytest.approx(lp.logprob, abs=1e-5)
    plain = image.replace(sampling=dataclasses.replace(image.request.sampling, prompt_logprobs=None))
    none, same, cached = asyncio.run(run(plain))
    assert (none, same) == (None, tokens) and cached > 0  # not asked: none, and the cache serves it


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
        request_id="p",
        prompt_token_ids=[5, 6, 7],
        sampling=SamplingParams(
            max_tokens=16, temperature=0.0, presence_penalty=presence, frequency_penalty=frequency, ignore_eos=True
        ),
    )
    ours, _ = asyncio.run(collect(engine, inp))
    assert ours == _penalized_greedy(reference, [5, 6, 7], 16, presence, frequency)


def test_sampling_rows_use_their_own_settings():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    params = [
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=1, temperature=1.0, top_k=1),
        SamplingParams(max_tokens=1, temperature=2.0, top_p=1e-9),
        SamplingParams(max_tokens=1, temperature=1.0, top_p=1e-46),  # 0.0 in float32: the best token still stays
        SamplingParams(max_tokens=1, temperature=0.7),
    ]
    gens = [None] + [torch.Generator().manual_seed(i) for i in range(4)]
    tokens, lps = sample(logits.clone(), params, gens, states_for(params, 50))
    best = logits.argmax(-1).tolist()
    assert tokens[:4] == best[:4] and lps == [None] * 5
    draws = {
        sample(logits[4:].clone(), params[4:], [torch.Generator().manual_seed(s)], states_for(params[4:], 50))[0][0]
        for s in range(40)
    }
    assert len(draws) > 3  # the free row really samples


def test_repetition_penalty_greedy_equals_transformers_generate_in_one_batch(checkpoint, reference, model, vision):
    """Rows with different penalties (one off, one below 1) and an image prompt, batched: each equals transformers'
    generate with its own repetition_penalty, which counts the prompt's tokens (image placeholders too)."""
    penalties = [1.0, 1.3, 2.0, 0.8]
    sizes = [[], [(64, 48)], [], []]
    requests = [
        request_for(
            checkpoint, reference, vision, s, seed=i, prefix=[5, 6, 7, 5, 6, last], max_tokens=16,
            repetition_penalty=p,
        )
        for i, (p, s, last) in enumerate(zip(penalties, sizes, [9, 10, 12, 13], strict=True))
    ]  # fmt: skip
    engine = make_engine(model, reference, max_num_batched_tokens=64, block_size=4, num_blocks=256)

    async def together():
        return await asyncio.gather(*(collect(engine, inp) for inp, _ in requests))

    outs = [ids for ids, _ in asyncio.run(together())]
    refs = [reference_generate(reference, ref, 16, repetition_penalty=p) for (_, ref), p in zip(requests, penalties)]
    assert outs == refs
    unpenalized = [reference_generate(reference, ref, 16) for _, ref in requests]
    assert [o != u for o, u in zip(outs, unpenalized, strict=True)] == [False, True, True, True]  # not vacuous


def test_min_tokens_holds_eos_back_as_transformers_min_new_tokens(reference, model):
    """EOS biased to be every step's winner: the answer ends at once, or after min_tokens tokens, as transformers'
    generate with min_new_tokens and the same bias."""
    eos = reference.generation_config.eos_token_id[0]
    engine = make_engine(model, reference)
    prompt = [5, 6, 7]

    def ours(min_tokens: int) -> tuple[list[int], str | None]:
        params = SamplingParams(max_tokens=12, temperature=0.0, min_tokens=min_tokens, logit_bias={eos: 100.0})
        return asyncio.run(
            collect(engine, GenerateRequest(request_id=f"m{min_tokens}", prompt_token_ids=prompt, sampling=params))
        )

    assert ours(0) == ([eos], "stop")
    tokens, finish = ours(5)
    ref = reference_generate(
        reference, {"input_ids": torch.tensor([prompt])}, 12, min_new_tokens=5, sequence_bias={(eos,): 100.0}
    )
    assert tokens == ref and len(tokens) == 6 and tokens[-1] == eos and finish == "stop"


def test_a_repetition_penalty_past_float32_still_samples_a_seen_token():
    """1e-300 is 0.0 in float32: a seen token's logit divided by it was inf, the softmax NaN, and token 0 came out.
    Such a penalty makes a seen token with a positive logit win outright (transformers' rule, taken to its limit)."""
    logits = torch.full((1, 50), -1.0)
    logits[0, 7], logits[0, 3] = 0.5, 2.0  # 3 is the best; 7 is seen, with a positive logit
    params = [SamplingParams(max_tokens=1, temperature=1.0, repetition_penalty=1e-300)]
    gens = [torch.Generator().manual_seed(0)]
    tokens, _ = sample(logits, params, gens, states_for(params, 50, prompt=[7]))
    assert tokens == [7]
