"""Prefill overlapped with encoding, through the engine: a request's images may arrive after it (as futures, in any
order); its prefill runs up to the first image not there, and the tokens are still transformers'. Qwen2-VL lays out a
late image from its M-RoPE grid, the LLaVAs (1-D RoPE) from the token count the ingress sends (MediaItem.num_tokens). A
late image that fails, or arrives with other rows than announced, fails the request with its error and frees its
blocks."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration, LlavaNextForConditionalGeneration

from demo.inputs import make_image
from demo.tiny_llava import build_llava_checkpoint
from demo.tiny_llava_next import build_llava_next_checkpoint
from encoders import LlavaNextVisionEncoder, LlavaVisionEncoder
from llm import Qwen2LM
from schemas import EncoderUnavailable, GenerateRequest, MediaItem, SamplingParams
from tests.llm.reference import Case, collect, make_engine, reference_generate, request_for

SIZES = [(64, 48), (30, 200), (120, 60)]  # three images: 12, 28 and 16 placeholder tokens
# LLaVA: 16 tokens each; LLaVA-NeXT: its tiles' (unpadded) features. The second and third are back to back in the
# prompt: only their counts tell where one ends.
LLAVA_SIZES = [(120, 80), (31, 200), (57, 31)]
LLAVA_PROMPT = "USER: <image>\nCompare <image><image>\nplease. ASSISTANT:"
LLAVAS = {
    "llava": (build_llava_checkpoint, LlavaForConditionalGeneration, LlavaVisionEncoder),
    "llava_next": (build_llava_next_checkpoint, LlavaNextForConditionalGeneration, LlavaNextVisionEncoder),
}


@dataclasses.dataclass(frozen=True, slots=True)
class Llava:
    checkpoint: Path
    reference: Any  # transformers' model on the same weights
    model: Qwen2LM
    vision: Any  # our encoder of the family


@pytest.fixture(scope="module", params=list(LLAVAS))
def llava(request, tmp_path_factory) -> Llava:
    build, reference_class, encoder_class = LLAVAS[request.param]
    checkpoint = build(tmp_path_factory.mktemp(request.param) / "tiny")
    reference = reference_class.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return Llava(checkpoint, reference, Qwen2LM.from_pretrained(checkpoint), encoder_class(checkpoint))


def llava_request(llava: Llava, seed: int) -> tuple[Case, list[int]]:
    """What the ingress sends for LLAVA_PROMPT (its grids and token counts from the family's own processing, as
    deployments/ingress/prepare.py takes them), and transformers' greedy tokens for the same prompt and images."""
    images = [make_image(w, h, seed=seed * 10 + i) for i, (w, h) in enumerate(LLAVA_SIZES)]
    inputs = AutoProcessor.from_pretrained(llava.checkpoint)(text=LLAVA_PROMPT, images=images, return_tensors="pt")
    with torch.no_grad():
        out = llava.reference.generate(**inputs, do_sample=False, max_new_tokens=12)
    ids, processing = inputs["input_ids"][0].tolist(), llava.vision.processing
    counts = [processing.num_image_tokens(w, h) for w, h in LLAVA_SIZES]
    embeds = llava.vision.encode(images)
    assert [int(e.shape[0]) for e in embeds] == counts  # the encoder's rows: what the ingress counted
    assert ids.count(llava.reference.config.image_token_id) == sum(counts)  # and what transformers' processor did
    items = [
        MediaItem(f"image-{seed}-{i}", processing.grid_thw(w, h), n, llava.reference.config.image_token_id)
        for i, ((w, h), n) in enumerate(zip(LLAVA_SIZES, counts, strict=True))
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    request = GenerateRequest(request_id=f"llava-{seed}", prompt_token_ids=ids, sampling=params, items=items)
    return Case(request, embeds), out[0, len(ids) :].tolist()


async def _until(condition, cap_s: float = 60.0) -> None:
    """Wait on the engine's state; the cap is generous, only there so that a broken engine fails, not hangs."""
    deadline = time.monotonic() + cap_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _record_steps(engine) -> list[list[tuple[str, int, int]]]:
    """Each step's chunks as (request id, start, n), recorded as the step runs."""
    steps = []
    engine.on_step = lambda chunks: steps.append([(c.seq.request_id, c.start, c.n) for c in chunks])
    return steps


def _spans(inp: Case, image_token_id: int) -> list[tuple[int, int]]:
    """Each image's placeholder run [start, end) in the prompt."""
    ids, spans, at = inp.request.prompt_token_ids, [], 0
    for e in inp.embeds:
        start = ids.index(image_token_id, at)
        spans.append((start, start + e.shape[0]))
        at = start + e.shape[0]
    return spans


LATE = [[1], [0, 2], [2, 1, 0]]
LATE_IDS = ["second", "first-and-last-out-of-order", "reversed"]


def _run_with_late_images(engine, inp: Case, spans: list[tuple[int, int]], late: list[int]) -> list[int]:
    """The images in `late` arrive one by one, in that order, each once the prefill stands still before the first
    one missing; -> the greedy tokens. The first chunk runs before any late image arrives."""
    steps, embeds = _record_steps(engine), list(inp.embeds)

    def computed() -> int:
        return sum(n for step in steps for _, _, n in step)

    async def scenario():
        futures = {i: asyncio.get_running_loop().create_future() for i in late}
        request = inp.replace(embeds=[futures.get(i, e) for i, e in enumerate(embeds)])
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
    assert steps[0] == [(inp.request.request_id, 0, spans[min(late)][0])]  # the first chunk ran before any late image
    return ours


@pytest.mark.parametrize("late", LATE, ids=LATE_IDS)
def test_prefill_runs_up_to_the_first_image_not_arrived(checkpoint, reference, model, vision, late):
    """Qwen2-VL (M-RoPE: each image's grid gives its tokens); the tokens equal transformers' over the whole prompt."""
    inp, ref = request_for(checkpoint, reference, vision, SIZES, seed=3, prefix=[11, 12, 13])
    engine = make_engine(model, reference)
    ours = _run_with_late_images(engine, inp, _spans(inp, reference.config.image_token_id), late)
    assert ours == reference_generate(reference, ref, max_new_tokens=12)
    engine.close()


@pytest.mark.parametrize("late", LATE, ids=LATE_IDS)
def test_llava_prefill_runs_up_to_the_first_image_not_arrived(llava, late):
    """A 1-D RoPE family: the ingress's token counts (MediaItem.num_tokens) lay out the images before they arrive."""
    inp, expected = llava_request(llava, seed=3)
    engine = make_engine(llava.model, llava.reference)
    assert _run_with_late_images(engine, inp, _spans(inp, llava.reference.config.image_token_id), late) == expected
    engine.close()


def test_a_late_image_with_other_rows_than_announced_fails_only_its_request(llava):
    """Its sequence fails with both numbers and frees its blocks; the request beside it, in the same steps, still
    gets transformers' tokens."""
    bad, _ = llava_request(llava, seed=4)
    other, expected = llava_request(llava, seed=5)
    engine = make_engine(llava.model, llava.reference, block_size=4)
    steps, (s, e) = _record_steps(engine), _spans(bad, llava.reference.config.image_token_id)[1]

    async def scenario():
        loop = asyncio.get_running_loop()
        late_bad, late_other = loop.create_future(), loop.create_future()
        embeds = [bad.embeds[0], late_bad, bad.embeds[2]]
        failing = asyncio.create_task(collect(engine, bad.replace(embeds=embeds)))
        embeds = [late_other, *other.embeds[1:]]  # its own cache scope: no prefix block shared with `bad`
        going = asyncio.create_task(collect(engine, other.replace(embeds=embeds, cache_scope="b")))
        ids = {bad.request.request_id, other.request.request_id}
        await _until(lambda: {r for step in steps for r, _, _ in step} == ids)
        late_bad.set_result(bad.embeds[1][:-1])  # one row short of what the ingress announced
        with pytest.raises(ValueError, match=f"image 1: {e - s - 1} embedding rows for {e - s} placeholder tokens"):
            await failing
        late_other.set_result(other.embeds[0])
        return await going

    assert asyncio.run(scenario())[0] == expected
    assert engine.stats()["failed"] == 1 and engine.stats()["running"] == 0
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.close()


def test_llava_image_counts_are_checked_at_submit(llava):
    """An embedding already there must have the announced rows: refused before the sequence takes any block."""
    inp, _ = llava_request(llava, seed=6)
    engine = make_engine(llava.model, llava.reference)
    n = inp.request.items[2].num_tokens
    short = inp.replace(embeds=[*inp.embeds[:2], inp.embeds[2][:-1]])
    with pytest.raises(ValueError, match=f"image 2: {n - 1} embedding rows for {n} placeholder tokens"):
        asyncio.run(collect(engine, short))
    assert engine.pool.num_free == engine.pool.num_blocks and engine.stats()["running"] == 0
    engine.close()


def test_a_failing_late_image_fails_the_request_and_frees_its_blocks(checkpoint, reference, model, vision):
    inp, _ = request_for(checkpoint, reference, vision, SIZES[:2], seed=4, prefix=[11, 12, 13])
    engine = make_engine(model, reference, block_size=4)
    steps = _record_steps(engine)

    async def scenario():
        late = asyncio.get_running_loop().create_future()
        request = inp.replace(embeds=[inp.embeds[0], late])
        task = asyncio.create_task(collect(engine, request))
        await _until(lambda: steps)  # text and the first image prefilled: it holds blocks
        assert engine.pool.num_free < engine.pool.num_blocks
        late.set_exception(EncoderUnavailable("no embeddings for images [1]", [1]))
        with pytest.raises(EncoderUnavailable) as e:
            await task
        return e.value

    assert asyncio.run(scenario()).calls == [1]  # what the ingress retries
    assert engine.stats()["failed"] == 1 and engine.stats()["running"] == 0
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.close()


def test_a_request_waiting_for_an_image_does_not_hold_back_the_others(checkpoint, reference, model, vision):
    inp, _ = request_for(checkpoint, reference, vision, SIZES[:1], seed=5, prefix=[11, 12, 13])
    text = GenerateRequest(
        request_id="text", prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=4, temperature=0.0)
    )
    engine = make_engine(model, reference, max_num_seqs=2)

    async def scenario():
        late = asyncio.get_running_loop().create_future()
        waiting = asyncio.create_task(collect(engine, inp.replace(embeds=[late])))
        tokens, finish = await collect(engine, text)  # admitted and finished while the other waits
        assert len(tokens) == 4 and finish == "length" and not waiting.done()
        late.set_result(inp.embeds[0])
        return await waiting

    assert asyncio.run(scenario())[1] in ("stop", "length")
    engine.close()
