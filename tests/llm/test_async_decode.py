"""Decode steps launched ahead (engine.py, `async_decode`): the step after a decode-only step is queued before that
step's tokens reach the host, its input tokens taken on the device. The tokens, finish reasons, logprobs and the
pool's blocks equal the synchronous engine's whatever ends a sequence (a stop token, max_tokens, a cancel) and
whatever joins the batch; rows that read the host's token history (penalties, grammars, logprobs, min_tokens) run
synchronously. On CPU the device work is synchronous too, so these tests check the bookkeeping; the GPU test checks
that a launched step makes no host sync."""

from __future__ import annotations

import asyncio

import pytest
import torch

from llm import Qwen2LM
from schemas import GenerateRequest, SamplingParams
from tests.llm.reference import collect, make_engine


def _req(i: int, n: int, **sampling) -> GenerateRequest:
    params = SamplingParams(**{"max_tokens": 16, "temperature": 0.0, **sampling})
    return GenerateRequest(
        request_id=f"r{i}", prompt_token_ids=[3 + (7 * i + j) % 90 for j in range(n)], sampling=params
    )


def _run(engine, requests: list[GenerateRequest], stagger_s: float = 0.0) -> list[tuple[list[int], str | None]]:
    async def one(k: int, inp: GenerateRequest):
        await asyncio.sleep(k * stagger_s)
        return await collect(engine, inp)

    async def together():  # a cap, so that a broken engine fails rather than hangs
        return await asyncio.wait_for(asyncio.gather(*(one(k, inp) for k, inp in enumerate(requests))), 120)

    return asyncio.run(together())


def _both(model, reference, requests, stagger_s: float = 0.0, **kw):
    """The same requests through the synchronous engine and the one that launches ahead (both static steps)."""
    sync = make_engine(model, reference, static_decode=True, async_decode=False, **kw)
    ahead = make_engine(model, reference, static_decode=True, async_decode=True, **kw)
    assert not sync.ahead and ahead.ahead
    return _run(sync, requests, stagger_s), _run(ahead, requests, stagger_s), sync, ahead


def _settled(engine) -> bool:
    return not engine.scheduler.running and engine.pool.num_free == engine.pool.num_blocks


def test_plain_rows_launch_ahead_with_the_same_tokens(model, reference):
    """Greedy and seeded rows, max_tokens from 1 to 16 (some rows end while the step after them is in flight),
    prompts of different lengths."""
    requests = [
        _req(0, 5, max_tokens=1),
        _req(1, 17, max_tokens=3),
        _req(2, 40, max_tokens=16, ignore_eos=True),
        _req(3, 9, temperature=0.9, seed=7, max_tokens=12),
        _req(4, 30, temperature=0.7, top_k=20, top_p=0.9, seed=3, max_tokens=9, logit_bias={5: 3.0}),
        _req(5, 64, max_tokens=7),
    ]
    sync, ahead, _, engine = _both(model, reference, requests)
    assert ahead == sync
    assert engine.stats()["ahead_steps"] >= 8  # most of the 15 decode steps after the first were launched ahead
    assert _settled(engine)


def test_a_stop_token_ends_the_sequence_while_its_next_step_is_in_flight(model, reference):
    first, _ = _run(make_engine(model, reference, static_decode=True, async_decode=False), [_req(0, 12)])[0]
    stop = first[4]  # the fifth greedy token (or an earlier one equal to it) stops it
    requests = [_req(0, 12, stop_token_ids=frozenset({stop})), _req(1, 20, ignore_eos=True)]
    sync, ahead, _, engine = _both(model, reference, requests)
    assert ahead == sync and sync[0] == (first[: first.index(stop) + 1], "stop")
    assert engine.stats()["ahead_steps"] > 0 and _settled(engine)


def test_rows_that_read_their_history_run_synchronously(model, reference):
    """A penalty, a grammar-free logprobs row and a pending min_tokens keep the batch synchronous (their sampling
    needs the last token on the host); once min_tokens is met and the others end, the rest launch ahead."""
    requests = [
        _req(0, 10, repetition_penalty=1.3, max_tokens=6),
        _req(1, 14, logprobs=True, top_logprobs=2, max_tokens=8),
        _req(2, 20, min_tokens=10, max_tokens=16, ignore_eos=True),
        _req(3, 25, frequency_penalty=0.5, presence_penalty=0.2, max_tokens=5),
    ]
    sync, ahead, _, engine = _both(model, reference, requests)
    assert ahead == sync
    assert engine.stats()["ahead_steps"] > 0  # the last request alone, after its min_tokens


def test_min_tokens_is_met_before_its_rows_launch_ahead(model, reference):
    """A stop token made the likeliest by logit_bias, masked by min_tokens until the sixth token: the sixth is it.
    (A row launched ahead while min_tokens is pending would mask it once more: its count lags a token.)"""
    stop = 50
    requests = [
        _req(0, 10, min_tokens=5, stop_token_ids=frozenset({stop}), logit_bias={stop: 100.0}, max_tokens=16),
        _req(1, 20, max_tokens=16, ignore_eos=True),
    ]
    sync, ahead, _, engine = _both(model, reference, requests)
    assert sync[0] == (sync[0][0][:5] + [stop], "stop") and stop not in sync[0][0][:5]
    assert ahead == sync and engine.stats()["ahead_steps"] > 0


def test_requests_joining_a_running_batch(model, reference):
    """Arrivals while decode steps are in flight: each is admitted at the next step, as without launching ahead."""
    requests = [_req(i, 8 + 5 * i, max_tokens=14, ignore_eos=True) for i in range(5)]
    sync, ahead, _, engine = _both(model, reference, requests, stagger_s=0.03)
    assert ahead == sync
    assert engine.stats()["ahead_steps"] > 0 and _settled(engine)


def test_a_cancelled_stream_frees_its_blocks(model, reference):
    engine = make_engine(model, reference, static_decode=True, async_decode=True)

    async def scenario():
        other = asyncio.ensure_future(collect(engine, _req(1, 11, max_tokens=40, ignore_eos=True)))
        stream = engine.generate(_req(0, 9, max_tokens=200, ignore_eos=True))
        got = []
        async for chunk in stream:
            got += chunk.token_ids
            if len(got) >= 5:
                break
        await stream.aclose()
        return got, await other

    got, (tokens, finish) = asyncio.run(scenario())
    assert len(got) >= 5 and len(tokens) == 40 and finish == "length"
    assert engine.stats()["cancelled"] == 1 and engine.stats()["ahead_steps"] > 0
    assert _settled(engine)


def test_few_free_blocks_fall_back_to_schedule(model, reference):
    """With a pool just large enough, the step ahead is not launched when its blocks are not free (it never
    preempts); preemptions then happen as without launching ahead."""
    requests = [_req(i, 30, max_tokens=40, ignore_eos=True) for i in range(3)]
    sync, ahead, _, engine = _both(model, reference, requests, num_blocks=12, max_model_len=128)
    assert ahead == sync and _settled(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_launched_step_makes_no_host_sync(checkpoint, reference, monkeypatch):
    """On cuda the engine launches ahead by default (with CUDA graphs), its tokens equal the synchronous engine's,
    and `launch` (buffer fill, graph replay, sampling, the copy of the tokens) runs under the sync debug mode's
    "error": any host sync raises."""
    cuda = Qwen2LM.from_pretrained(checkpoint, device="cuda", dtype=torch.float32)
    requests = [
        _req(0, 10, max_tokens=12),
        _req(1, 33, temperature=0.8, seed=1, top_k=30, top_p=0.9),
        _req(2, 50, temperature=1.0, seed=2, min_p=0.05),
    ]
    sync = _run(make_engine(cuda, reference, async_decode=False), requests)
    engine = make_engine(cuda, reference)
    assert engine.ahead and engine.runner.static.graphs
    launch = engine.runner.launch

    def strict(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(engine.runner, "launch", strict)
    assert _run(engine, requests) == sync
    assert engine.stats()["ahead_steps"] > 0 and engine.stats()["failed"] == 0
