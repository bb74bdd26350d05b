"""The engine alone (no Ray): greedy parity with transformers' generate, seeds, stops, cancellation, queue bound."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from encoders import Qwen2VLVisionEncoder
from llm import Engine, Qwen2LM, SequenceInput
from schemas import InvalidRequest, Overloaded, SamplingParams
from tests.helpers import make_image


@pytest.fixture(scope="module")
def model(checkpoint):
    return Qwen2LM.from_pretrained(checkpoint)


def _engine(model, reference, **kw) -> Engine:
    kw = {"max_model_len": 512, "max_queued": 4, **kw}
    eos = set(reference.generation_config.eos_token_id)
    return Engine(model, image_token_id=reference.config.image_token_id, merge_size=2, eos_token_ids=eos, **kw)


async def _collect(engine: Engine, seq: SequenceInput) -> tuple[list[int], str | None]:
    ids, finish = [], None
    async for chunk in engine.generate(seq):
        ids += chunk.token_ids
        finish = chunk.finish_reason
    return ids, finish


def _seq(ids, grids=(), embeds=(), **sampling) -> SequenceInput:
    params = SamplingParams(**{"max_tokens": 12, "temperature": 0.0, **sampling})
    return SequenceInput("r", list(ids), list(grids), list(embeds), params)


@pytest.mark.parametrize("sizes", [[], [(64, 48)], [(30, 200), (120, 60)]])
def test_greedy_matches_transformers_generate(checkpoint, reference, model, sizes):
    cfg = reference.config
    images = [make_image(w, h, seed=i + 5) for i, (w, h) in enumerate(sizes)]
    ids, grids = [11, 12, 13], []
    if images:
        processed = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)(images=images, return_tensors="pt")
        for grid in processed["image_grid_thw"].tolist():
            grids.append(tuple(grid))
            ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (grid[1] * grid[2] // 4) + [cfg.vision_end_token_id, 14]
    input_ids = torch.tensor(ids)[None]
    kwargs = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]} if images else {}
    with torch.no_grad():
        ref = reference.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 mm_token_type_ids=(input_ids == cfg.image_token_id).int(), do_sample=False,
                                 max_new_tokens=12, **kwargs)[0, len(ids):].tolist()
    embeds = Qwen2VLVisionEncoder(checkpoint).encode(images) if images else []
    ours, finish = asyncio.run(_collect(_engine(model, reference), _seq(ids, grids, embeds)))
    assert ours == ref
    assert finish == ("stop" if ref[-1] in reference.generation_config.eos_token_id else "length")


def test_seed_reproducible_and_temperature_varies(model, reference):
    engine = _engine(model, reference)
    run = lambda **s: asyncio.run(_collect(engine, _seq([5, 6, 7], max_tokens=16, **s)))[0]  # noqa: E731
    assert run(temperature=1.0, seed=7) == run(temperature=1.0, seed=7)
    assert len({tuple(run(temperature=1.5, seed=s)) for s in range(6)}) > 1
    assert run(temperature=1.0, top_p=1e-6, seed=3) == run(temperature=0.0)  # top_p -> only the top token


def test_stop_token_ids_and_max_tokens(model, reference):
    engine = _engine(model, reference)
    greedy, _ = asyncio.run(_collect(engine, _seq([5, 6, 7], max_tokens=8)))
    ids, finish = asyncio.run(_collect(engine, _seq([5, 6, 7], max_tokens=8, stop_token_ids=frozenset({greedy[2]}))))
    assert ids == greedy[: greedy.index(greedy[2]) + 1] and finish == "stop"
    ids, finish = asyncio.run(_collect(engine, _seq([5, 6, 7], max_tokens=3)))
    assert len(ids) == 3 and finish == "length"


def test_context_limit_is_a_client_error(model, reference):
    engine = _engine(model, reference, max_model_len=20)
    with pytest.raises(InvalidRequest, match="15 prompt tokens \\+ max_tokens 6 exceed the context length of 20"):
        asyncio.run(_collect(engine, _seq(range(3, 18), max_tokens=6)))


def test_closing_the_stream_cancels_within_a_step(model, reference):
    engine = _engine(model, reference, max_model_len=4096)
    steps = []

    async def take_two_then_leave():
        gen = engine.generate(_seq([5, 6, 7], max_tokens=4000))
        async for chunk in gen:
            steps.append(chunk)
            if len(steps) == 2:
                break
        await gen.aclose()

    asyncio.run(take_two_then_leave())
    # The worker is free again at once: a new request completes quickly instead of waiting for 4000 tokens.
    started = time.monotonic()
    ids, _ = asyncio.run(_collect(engine, _seq([5, 6, 7], max_tokens=2)))
    assert len(ids) == 2 and time.monotonic() - started < 5


def test_queue_bound_gives_overloaded(model, reference):
    engine = _engine(model, reference, max_queued=1, max_model_len=4096)
    release = threading.Event()
    real_run = engine._run
    engine._run = lambda job: (release.wait(10), real_run(job))  # hold the worker on the first job

    async def scenario():
        first = engine.generate(_seq([5], max_tokens=1))
        task = asyncio.create_task(anext(first))
        await asyncio.sleep(0.2)  # the worker took the first job; the queue is empty again
        second = engine.generate(_seq([5], max_tokens=1))
        task2 = asyncio.create_task(anext(second))
        await asyncio.sleep(0.2)  # the second waits in the queue (bound 1)
        with pytest.raises(Overloaded, match="queue is full"):
            await anext(engine.generate(_seq([5], max_tokens=1)))
        release.set()
        assert (await task).finish_reason == "length"
        assert (await task2).finish_reason == "length"

    asyncio.run(scenario())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_float32_matches_cpu_and_bfloat16_runs(checkpoint, reference, model):
    ids = [5, 6, 7, 8]
    cpu, _ = asyncio.run(_collect(_engine(model, reference), _seq(ids)))
    cuda = Qwen2LM.from_pretrained(checkpoint, device="cuda", dtype=torch.float32)
    ours, _ = asyncio.run(_collect(_engine(cuda, reference), _seq(ids)))
    assert ours == cpu
    bf16 = Qwen2LM.from_pretrained(checkpoint, device="cuda", dtype=torch.bfloat16)
    tokens, finish = asyncio.run(_collect(_engine(bf16, reference), _seq(ids)))
    assert len(tokens) >= 1 and finish in ("stop", "length")


def test_tokens_before_a_fault_are_delivered_then_the_error(model, reference):
    engine = _engine(model, reference, max_model_len=4096)
    real_forward = model.forward

    def failing(inputs_embeds, positions, cache, start):
        if start == 8:
            raise RuntimeError("injected fault")
        return real_forward(inputs_embeds, positions, cache, start)

    async def scenario():
        received = []
        with pytest.raises(RuntimeError, match="injected fault"):
            async for chunk in engine.generate(_seq([5, 6, 7], max_tokens=20)):
                received += chunk.token_ids
                await asyncio.sleep(0.3)  # a slow consumer: the rest and the error arrive together
        return received

    model.forward = failing
    try:
        received = asyncio.run(scenario())
    finally:
        del model.forward
    assert len(received) == 6  # positions 3..7 decoded from 5 tokens, plus the first from prefill
    assert engine.stats()["failed"] == 1


def test_ignore_eos_runs_to_max_tokens(model, reference):
    greedy, _ = asyncio.run(_collect(_engine(model, reference), _seq([5, 6, 7], max_tokens=8)))
    eos_engine = _engine(model, reference)
    eos_engine.eos_token_ids = frozenset({greedy[1]})  # pretend the second token is EOS
    ids, finish = asyncio.run(_collect(eos_engine, _seq([5, 6, 7], max_tokens=8)))
    assert ids == greedy[: greedy.index(greedy[1]) + 1] and finish == "stop"
    ids, finish = asyncio.run(_collect(eos_engine, _seq([5, 6, 7], max_tokens=8, ignore_eos=True)))
    assert ids == greedy and finish == "length"
