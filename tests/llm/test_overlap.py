"""Prefill overlapped with encoding, through the engine: a request's images may arrive after it (as futures, in any
order); its prefill runs up to the first image not there, and the tokens are still transformers'. A late image that
fails fails the request with its error and frees its blocks."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from schemas import EncoderUnavailable, GenerateRequest, SamplingParams
from tests.llm.reference import collect, make_engine, reference_generate, request_for

SIZES = [(64, 48), (30, 200), (120, 60)]  # three images: 12, 28 and 16 placeholder tokens


async def _until(condition, cap_s: float = 60.0) -> None:
    """Wait on the engine's state; the cap is generous, only there so that a broken engine fails, not hangs."""
    deadline = time.monotonic() + cap_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _record_steps(engine) -> list[list[tuple[str, int, int]]]:
    """Each step's chunks as (request id, start, n), recorded as the step runs."""
    steps, real = [], engine._step

    def step(chunks):
        steps.append([(c.seq.request_id, c.start, c.n) for c in chunks])
        real(chunks)

    engine._step = step
    return steps


def _spans(inp: GenerateRequest, image_token_id: int) -> list[tuple[int, int]]:
    """Each image's placeholder run [start, end) in the prompt."""
    ids, spans, at = inp.prompt_token_ids, [], 0
    for e in inp.image_embeds:
        start = ids.index(image_token_id, at)
        spans.append((start, start + e.shape[0]))
        at = start + e.shape[0]
    return spans


@pytest.mark.parametrize("late", [[1], [0, 2], [2, 1, 0]], ids=["second", "first-and-last-out-of-order", "reversed"])
def test_prefill_runs_up_to_the_first_image_not_arrived(checkpoint, reference, model, vision, late):
    """The images in `late` arrive one by one, in that order, each once the prefill stands still before the first
    one missing; the tokens equal transformers' over the whole prompt."""
    inp, ref = request_for(checkpoint, reference, vision, SIZES, seed=3, prefix=[11, 12, 13])
    spans, embeds = _spans(inp, reference.config.image_token_id), list(inp.image_embeds)
    engine = make_engine(model, reference)
    steps = _record_steps(engine)

    def computed() -> int:
        return sum(n for step in steps for _, _, n in step)

    async def scenario():
        futures = {i: asyncio.get_running_loop().create_future() for i in late}
        request = dataclasses.replace(inp, image_embeds=[futures.get(i, e) for i, e in enumerate(embeds)])
        task = asyncio.create_task(collect(engine, request))
        missing = set(late)
        for i in [*late, None]:
            first_missing = min(missing, default=None)
            expected = spans[first_missing][0] if first_missing is not None else None
            if expected is not None:  # the prefill ran up to the missing image's first token, and stands there
                await _until(lambda e=expected: computed() == e)
                await asyncio.sleep(0.05)  # a few more chances to run past it (the assertion is the state, below)
                assert computed() == expected, (steps, spans, missing)
                assert not task.done()
            if i is not None:
                futures[i].set_result(embeds[i])
                missing.discard(i)
        return await task

    ours, _ = asyncio.run(scenario())
    assert ours == reference_generate(reference, ref, max_new_tokens=12)
    assert steps[0] == [(inp.request_id, 0, spans[min(late)][0])]  # the first chunk ran before any late image
    engine.close()


def test_a_failing_late_image_fails_the_request_and_frees_its_blocks(checkpoint, reference, model, vision):
    inp, _ = request_for(checkpoint, reference, vision, SIZES[:2], seed=4, prefix=[11, 12, 13])
    engine = make_engine(model, reference, block_size=4)
    steps = _record_steps(engine)

    async def scenario():
        late = asyncio.get_running_loop().create_future()
        request = dataclasses.replace(inp, image_embeds=[inp.image_embeds[0], late])
        task = asyncio.create_task(collect(engine, request))
        await _until(lambda: steps)  # text and the first image prefilled: it holds blocks
        assert engine.pool.num_free < engine.pool.num_blocks
        late.set_exception(EncoderUnavailable("no embeddings for images [1]", [1]))
        with pytest.raises(EncoderUnavailable) as e:
            await task
        return e.value

    assert asyncio.run(scenario()).image_indices == [1]  # what the ingress retries
    assert engine.stats()["failed"] == 1 and engine.stats()["running"] == 0
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.close()


def test_a_request_waiting_for_an_image_does_not_hold_back_the_others(checkpoint, reference, model, vision):
    inp, _ = request_for(checkpoint, reference, vision, SIZES[:1], seed=5, prefix=[11, 12, 13])
    text = GenerateRequest("text", [5, 6, 7], [], [], SamplingParams(max_tokens=4, temperature=0.0))
    engine = make_engine(model, reference, max_num_seqs=2)

    async def scenario():
        late = asyncio.get_running_loop().create_future()
        waiting = asyncio.create_task(collect(engine, dataclasses.replace(inp, image_embeds=[late])))
        tokens, finish = await collect(engine, text)  # admitted and finished while the other waits
        assert len(tokens) == 4 and finish == "length" and not waiting.done()
        late.set_result(inp.image_embeds[0])
        return await waiting

    assert asyncio.run(scenario())[1] in ("stop", "length")
    engine.close()
