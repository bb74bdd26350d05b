"""The engine alone (no Ray): greedy parity with transformers, alone and in mixed batches, seeds, stops,
cancellation, the queue bound, faults."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import pytest
import torch

from llm import Qwen2LM
from schemas import GenerateRequest, InvalidRequest, MediaItem, Overloaded, SamplingParams
from tests.llm.reference import Case, collect, make_engine, reference_generate, request_for

CASES = {"text": [], "one_image": [(64, 48)], "two_images": [(30, 200), (120, 60)], "small_image": [(28, 28)]}


async def _until(condition, cap_s: float = 60.0) -> None:
    """Wait on the engine's state; the cap is generous, only there so that a broken engine fails, not hangs."""
    deadline = time.monotonic() + cap_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _seq(ids, **sampling) -> GenerateRequest:
    params = SamplingParams(**{"max_tokens": 12, "temperature": 0.0, **sampling})
    return GenerateRequest(request_id="r", prompt_token_ids=list(ids), sampling=params)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers_generate(checkpoint, reference, model, vision, case):
    inp, ref = request_for(checkpoint, reference, vision, CASES[case], seed=5, prefix=[11, 12, 13])
    ours, finish = asyncio.run(collect(make_engine(model, reference), inp))
    assert ours == reference_generate(reference, ref, max_new_tokens=12)
    assert finish == ("stop" if ours[-1] in reference.generation_config.eos_token_id else "length")


@pytest.mark.parametrize(("budget", "block_size"), [(1024, 16), (7, 4)])
def test_mixed_batch_matches_transformers_one_by_one(checkpoint, reference, model, vision, budget, block_size):
    """Text-only, one-image and two-image prompts of different lengths, generated together in one batch; with a
    7-token budget every prefill goes in chunks that cut through images."""
    requests = [
        request_for(checkpoint, reference, vision, sizes, seed=i, prefix=list(range(3, 3 + 2 * i + 1)))
        for i, sizes in enumerate([[], [(64, 48)], [(30, 200), (120, 60)], [], [(28, 28)]])
    ]
    engine = make_engine(model, reference, max_num_batched_tokens=budget, block_size=block_size, num_blocks=512)

    async def together():
        return await asyncio.gather(*(collect(engine, inp) for inp, _ in requests))

    results = asyncio.run(together())
    for (inp, ref), (ours, _) in zip(requests, results, strict=True):
        assert ours == reference_generate(reference, ref, max_new_tokens=inp.request.sampling.max_tokens)
    assert engine.stats()["steps"] < sum(len(ours) for ours, _ in results)  # sequences really shared steps


def test_seed_reproducible_whatever_the_neighbours(model, reference):
    engine = make_engine(model, reference)
    run = lambda **s: asyncio.run(collect(engine, _seq([5, 6, 7], max_tokens=16, **s)))[0]  # noqa: E731
    alone = run(temperature=1.0, seed=7)
    assert alone == run(temperature=1.0, seed=7)
    assert len({tuple(run(temperature=1.5, seed=s)) for s in range(6)}) > 1

    async def crowded():
        others = [collect(engine, _seq(range(3, 3 + k), max_tokens=16, temperature=1.0)) for k in range(1, 6)]
        mine, *_ = await asyncio.gather(
            collect(engine, _seq([5, 6, 7], max_tokens=16, temperature=1.0, seed=7)), *others
        )
        return mine[0]

    assert asyncio.run(crowded()) == alone


def test_top_k_top_p_extremes_are_greedy(model, reference):
    engine = make_engine(model, reference)
    greedy, _ = asyncio.run(collect(engine, _seq([5, 6, 7])))
    assert asyncio.run(collect(engine, _seq([5, 6, 7], temperature=1.0, top_p=1e-6, seed=3)))[0] == greedy
    assert asyncio.run(collect(engine, _seq([5, 6, 7], temperature=1.3, top_k=1, seed=4)))[0] == greedy


def test_stop_token_ids_max_tokens_and_ignore_eos(model, reference):
    engine = make_engine(model, reference)
    greedy, _ = asyncio.run(collect(engine, _seq([5, 6, 7], max_tokens=8)))
    stop = greedy[2]
    ids, finish = asyncio.run(collect(engine, _seq([5, 6, 7], max_tokens=8, stop_token_ids=frozenset({stop}))))
    assert ids == greedy[: greedy.index(stop) + 1] and finish == "stop"
    ids, finish = asyncio.run(collect(engine, _seq([5, 6, 7], max_tokens=3)))
    assert ids == greedy[:3] and finish == "length"
    engine.eos_token_ids = frozenset({greedy[1]})  # pretend the second token is EOS
    ids, finish = asyncio.run(collect(engine, _seq([5, 6, 7], max_tokens=8)))
    assert ids == greedy[: greedy.index(greedy[1]) + 1] and finish == "stop"
    ids, finish = asyncio.run(collect(engine, _seq([5, 6, 7], max_tokens=8, ignore_eos=True)))
    assert ids == greedy and finish == "length"


def test_context_limit_is_a_client_error(model, reference):
    engine = make_engine(model, reference, max_model_len=20, num_blocks=4, block_size=8)
    with pytest.raises(InvalidRequest, match="15 prompt tokens \\+ max_tokens 6 exceed the context length of 20"):
        asyncio.run(collect(engine, _seq(range(3, 18), max_tokens=6)))


def test_what_the_ingress_checked_is_asserted_not_checked_again(model, reference):
    """Placeholder ids with no image or video are the ingress's to refuse (typed as text: a 400 on every route,
    tests/deployments/test_completions.py); the engine asserts the counts agree and goes on serving."""
    engine, pad = make_engine(model, reference), reference.config.image_token_id
    with pytest.raises(AssertionError, match="0 image or video tokens for 2 placeholder tokens"):
        asyncio.run(collect(engine, _seq([5, pad, 6, pad, 7])))
    assert asyncio.run(collect(engine, _seq([5, 6, 7], max_tokens=2)))[1] == "length"  # and it goes on


def test_closing_the_stream_frees_the_sequence(model, reference):
    engine = make_engine(model, reference, max_model_len=4096, num_blocks=300)

    async def take_two_then_leave():
        gen = engine.generate(_seq([5, 6, 7], max_tokens=4000))
        n = 0
        async for _ in gen:
            n += 1
            if n == 2:
                break
        await gen.aclose()
        await _until(lambda: engine.stats()["running"] == 0)  # the worker notices at its next step

    asyncio.run(take_two_then_leave())
    stats = engine.stats()
    assert stats["running"] == 0 and stats["cancelled"] == 1 and stats["finished"] == 0
    assert engine.pool.num_free == engine.pool.num_blocks  # every block back in the pool


def test_queue_bound_gives_overloaded(model, reference):
    engine = make_engine(model, reference, max_queued=1, max_num_seqs=1, max_model_len=4096, num_blocks=300)

    async def scenario():
        first = asyncio.create_task(collect(engine, _seq([5], max_tokens=3000)))
        await _until(lambda: engine.stats()["running"] == 1)  # running (the batch holds one sequence)
        second = asyncio.create_task(collect(engine, _seq([5], max_tokens=1)))
        await _until(lambda: engine.stats()["waiting"] == 1)  # waiting: the queue (bound 1) is full
        with pytest.raises(Overloaded, match="queue is full"):
            await anext(engine.generate(_seq([5], max_tokens=1)))
        first.cancel()
        assert (await second)[1] == "length"

    asyncio.run(scenario())


def test_an_admitted_sequence_frees_its_queue_place_during_its_first_step(model, reference):
    """Queue bound 1: while the first sequence's (slow) first step runs, a second one may wait; it is not refused."""
    engine = make_engine(model, reference, max_queued=1, max_num_seqs=1, max_model_len=4096, num_blocks=300)
    first_step, release = threading.Event(), threading.Event()

    def slow(chunks):
        if not first_step.is_set():
            first_step.set()
            assert release.wait(60), "never released"  # held until the second sequence is in the queue

    engine.on_step = slow

    async def scenario():
        first = asyncio.create_task(collect(engine, _seq([5], max_tokens=2)))
        await _until(first_step.is_set)
        second = asyncio.create_task(collect(engine, _seq([6], max_tokens=1)))
        await _until(lambda: second.done() or engine.stats()["waiting"] == 1)
        if second.done():
            second.result()  # refused: raises the engine's Overloaded
        release.set()
        assert (await second)[1] == "length"  # waited, then ran
        await first

    asyncio.run(scenario())


def test_tokens_before_a_fault_are_delivered_then_the_error(model, reference):
    engine = make_engine(model, reference, max_model_len=4096, num_blocks=300)
    steps = []

    def failing(chunks):
        steps.append(len(steps))
        if len(steps) == 7:
            raise RuntimeError("injected fault")

    engine.on_step = failing

    async def scenario():
        received = []
        with pytest.raises(RuntimeError, match="injected fault"):
            async for chunk in engine.generate(_seq([5, 6, 7], max_tokens=20)):
                received += chunk.token_ids
                await _until(lambda: engine.stats()["failed"] == 1)  # a slow consumer: the fault came first
        return received

    assert len(asyncio.run(scenario())) == 6  # six steps made six tokens before the seventh failed
    assert engine.stats()["failed"] == 1 and engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_float32_matches_cpu_and_bfloat16_runs(checkpoint, reference, model):
    cpu, _ = asyncio.run(collect(make_engine(model, reference), _seq([5, 6, 7, 8])))
    cuda = Qwen2LM.from_pretrained(checkpoint, device="cuda", dtype=torch.float32)
    assert asyncio.run(collect(make_engine(cuda, reference), _seq([5, 6, 7, 8])))[0] == cpu
    bf16 = Qwen2LM.from_pretrained(checkpoint, device="cuda", dtype=torch.bfloat16)
    tokens, finish = asyncio.run(collect(make_engine(bf16, reference), _seq([5, 6, 7, 8])))
    assert len(tokens) >= 1 and finish in ("stop", "length")


def test_embedding_rows_must_match_the_image_grid(model, reference):
    """With M-RoPE the grid gives an image's tokens: the count the ingress announced is the grid's (asserted), and an
    embedding from the encoder must have that many rows (checked: another process made it)."""
    engine = make_engine(model, reference)
    pad = reference.config.image_token_id
    request = GenerateRequest(
        request_id="r", prompt_token_ids=[5, pad, pad, pad, pad, 6], sampling=SamplingParams(max_tokens=2)
    )
    rows = Case(replace(request, items=[MediaItem("", (1, 4, 4), 4, pad)]), [torch.zeros(3, 64)])
    with pytest.raises(ValueError, match="image 0: 3 embedding rows for 4 placeholder tokens"):
        asyncio.run(collect(engine, rows))
    grid = Case(replace(request, items=[MediaItem("", (1, 4, 4), 3, pad)]), [torch.zeros(3, 64)])
    with pytest.raises(AssertionError, match="image 0: 3 tokens for a grid of 16 patches"):  # the ingress's count
        asyncio.run(collect(engine, grid))
    assert asyncio.run(collect(engine, _seq([5, 6, 7], max_tokens=2)))[1] == "length"  # and it goes on


def test_kv_cache_must_hold_one_full_sequence():
    from llm import num_kv_blocks

    kw = {"block_size": 16, "device": torch.device("cpu"), "gpu_memory_utilization": 0.9, "cpu_kv_cache_gib": 1.0}
    assert num_kv_blocks(1024, max_model_len=4096, kv_cache_tokens=8192, **kw) == 512
    assert num_kv_blocks(1 << 20, max_model_len=512, kv_cache_tokens=None, **kw) == 1024 // 16  # 1 GiB of 1 MiB tokens
    with pytest.raises(ValueError, match="holds 2048 tokens, fewer than max_model_len=4096"):
        num_kv_blocks(1024, max_model_len=4096, kv_cache_tokens=2048, **kw)


def test_the_engine_runs_its_largest_step_once_at_start(model, reference, monkeypatch):
    """max_num_batched_tokens=300 over a 256-token context: two sequences' chunks (256 + 44), before any request."""
    seen, real = [], model.forward

    def forward(embeds, positions, cache, meta, deepstack=None):
        seen.append((embeds.shape[0], positions.shape))
        return real(embeds, positions, cache, meta, deepstack)

    monkeypatch.setattr(model, "forward", forward)
    engine = make_engine(model, reference, max_model_len=256, max_num_batched_tokens=300, num_blocks=64)
    assert seen == [(300, (3, 300))]
    assert engine.pool.num_free == engine.pool.num_blocks  # the step's KV went to free blocks, none kept
    ours, _ = asyncio.run(collect(engine, _seq([5, 6, 7], max_tokens=4)))
    monkeypatch.undo()
    assert ours == asyncio.run(collect(make_engine(model, reference), _seq([5, 6, 7], max_tokens=4)))[0]
    engine.close()


def test_a_step_that_does_not_fit_fails_the_start_and_names_the_setting(model, reference, monkeypatch):
    def forward(embeds, positions, cache, meta, deepstack=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(model, "forward", forward)
    with pytest.raises(MemoryError, match=r"llm\.max_num_batched_tokens=1024 tokens does not fit"):
        make_engine(model, reference, max_num_batched_tokens=1024)
