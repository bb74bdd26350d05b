"""Decode attention and the linears' column chunks shared with the helper thread (llm/model/cpu_share.h): the same
output as on one thread, the helper takes tasks, a helper stuck in a task never holds the caller up nor writes after
the call returned, and a process with a helper exits cleanly."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from llm.model import cpu_kernels
from llm.model.layers import Linear, pack_linears

NKV, GROUP, HD, BS = 2, 3, 64, 16


@pytest.fixture
def kernels():
    assert cpu_kernels.load() is not None, "the CPU kernel must build here (C++ compiler and ninja)"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as an engine's worker in a decode step: a caller with a team runs its chunks itself
    yield cpu_kernels
    cpu_kernels.use_helper(False)
    torch.set_num_threads(threads)


def _problem(dtype: torch.dtype, batch: int = 32, seed: int = 0):
    """A decode batch of `batch` rows with contexts of 60-300 tokens in blocks scattered over the pool."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    lens = [rng.randint(60, 300) for _ in range(batch)]
    width = max(-(-n // BS) for n in lens)
    num_blocks = sum(-(-n // BS) for n in lens) + 3
    kv = torch.randn(2 * NKV, num_blocks, BS, HD, generator=gen).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = torch.zeros(batch, width, dtype=torch.int32)
    for b, n in enumerate(lens):
        tables[b, : -(-n // BS)] = torch.tensor([free.pop() for _ in range(-(-n // BS))], dtype=torch.int32)
    q = torch.randn(batch, NKV * GROUP, HD, generator=gen).to(dtype)
    return q, kv, tables, torch.tensor(lens, dtype=torch.int32), HD**-0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_output_is_the_one_thread_output_and_the_helper_takes_tasks(kernels, dtype):
    args = _problem(dtype)
    alone = kernels.paged_decode_cpu(*args)
    kernels.use_helper(True)
    # Each task runs the same code on either thread: the outputs are equal bit for bit.
    _helper_takes_some(kernels, lambda: torch.equal(kernels.paged_decode_cpu(*args), alone) or pytest.fail("differs"))


def test_small_calls_stay_on_the_caller(kernels):
    q, kv, tables, lens, scale = _problem(torch.float32, batch=2)
    lens = torch.tensor([5, 7], dtype=torch.int32)  # 24 keys: waking the helper would cost more than it takes
    kernels.use_helper(True)
    offered = kernels.helper_stats()[0]
    kernels.paged_decode_cpu(q, kv, tables, lens, scale)
    assert kernels.helper_stats()[0] == offered


def test_a_helper_stuck_in_a_task_is_taken_over_and_its_late_result_dropped(kernels):
    args = _problem(torch.float32)
    alone = kernels.paged_decode_cpu(*args)
    kernels.use_helper(True, delay_us=2_000_000)  # the helper sleeps 2 s in every task it claims
    stolen = kernels.helper_stats()[2]
    deadline = time.monotonic() + 30
    while kernels.helper_stats()[2] == stolen and time.monotonic() < deadline:
        started = time.monotonic()
        out = kernels.paged_decode_cpu(*args)
        # NOTE: a bound, not a speed claim: the call would last 2 s if it waited for the helper's task.
        assert time.monotonic() - started < 1.0
        assert torch.equal(out, alone)
        out.zero_()
    assert kernels.helper_stats()[2] > stolen, "the helper never claimed a task in 30 s"
    time.sleep(2.5)  # the helper wakes, finishes the task it was taken off, and must drop its result
    assert torch.count_nonzero(out) == 0


def _helper_takes_some(kernels, call, *, seconds: float = 30) -> tuple:
    """Calls `call` until the helper has computed a task of one; returns helper_stats() before."""
    before = kernels.helper_stats()
    deadline = time.monotonic() + seconds
    while kernels.helper_stats()[1] == before[1] and time.monotonic() < deadline:
        call()
    assert kernels.helper_stats()[1] > before[1], f"the helper took no task in {seconds} s: {kernels.helper_stats()}"
    return before


@pytest.mark.parametrize("T", [1, 3, 32, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_linears_equal_the_whole_packed_linear_and_share_their_chunks(kernels, float32_packing, T, bias):
    """oneDNN's weights are packed in column chunks for the helper; our panels are split into its tasks at each call
    (the second linear's 6 panels into 3)."""
    torch.manual_seed(T)
    model = torch.nn.Sequential(Linear(512, 1024, bias=bias), Linear(1024, 96, bias=bias))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(T, 512)
    with torch.no_grad():
        assert pack_linears(model) == 2 and all(len(m.packed) == 1 for m in model)
        whole = model(x)
        kernels.use_helper(True)
        assert pack_linears(model, kernels.SHARE_CHUNKS) == 2
        chunks = 1 if float32_packing == "panels" else kernels.SHARE_CHUNKS
        assert [len(m.packed) for m in model] == [chunks] * 2
        calls = kernels.calls
        alone = model(x)
        assert kernels.calls == calls + 2  # one kernel call per linear (op counts add these)
        torch.testing.assert_close(alone, whole, rtol=1e-5, atol=1e-5)
        # Each task is the same call on either thread: shared equals alone bit for bit (and, on panels, the tiles
        # are the same as the whole linear's).
        _helper_takes_some(kernels, lambda: torch.equal(model(x), alone) or pytest.fail("shared differs"))
        if float32_packing == "panels":
            assert torch.equal(alone, whole)


def test_a_linear_with_an_openmp_team_runs_it_itself(kernels, float32_packing):
    """A prefill chunk on a node's idle cores (the engine's threads follow the load) has a team of its own: oneDNN's
    chunks, or our GEMM's panels split over the team, run on it; the helper is offered nothing."""
    kernels.use_helper(True)
    w = torch.randn(256, 64)
    packed = kernels.pack_chunks(w)
    threads = torch.get_num_threads()
    try:
        for team in (2, 3):
            torch.set_num_threads(team)
            offered = kernels.helper_stats()[0]
            x = torch.randn(40, 64)
            torch.testing.assert_close(kernels.linear(x, w, None, packed), x @ w.T, rtol=1e-5, atol=1e-5)
            assert kernels.helper_stats()[0] == offered
        torch.set_num_threads(1)
        kernels.linear(torch.randn(8, 64), w, None, packed)
        assert kernels.helper_stats()[0] == offered + 1
    finally:
        torch.set_num_threads(threads)


def test_a_linear_never_waits_for_a_stuck_helper_nor_takes_its_late_result(kernels, float32_packing):
    x, weight = torch.randn(1, 512), torch.randn(1024, 512) / 512**0.5
    kernels.use_helper(True)
    packed = kernels.pack_chunks(weight)
    alone = kernels.linear(x, weight, None, packed)
    kernels.use_helper(True, delay_us=2_000_000)  # the helper sleeps 2 s in every chunk it claims
    stolen = kernels.helper_stats()[2]
    deadline = time.monotonic() + 30
    while kernels.helper_stats()[2] == stolen and time.monotonic() < deadline:
        started = time.monotonic()
        out = kernels.linear(x, weight, None, packed)  # one row: the output is the chunks' own buffer
        assert time.monotonic() - started < 1.0  # a bound: waiting for the helper's chunk would take 2 s
        assert torch.equal(out, alone)
        out.zero_()
    assert kernels.helper_stats()[2] > stolen, "the helper never claimed a chunk in 30 s"
    time.sleep(2.5)
    assert torch.count_nonzero(out) == 0


@pytest.mark.skipif(not cpu_kernels.can_pack(), reason="this torch has no oneDNN weight packing")
@pytest.mark.parametrize("case", [[(64, 48)], [(30, 200), (120, 60)]])
def test_greedy_through_shared_linears_matches_transformers(checkpoint, reference, model, vision, case):
    """An engine whose decode steps run on one thread (as a served CPU replica's) packs its weights (oneDNN's in chunks;
    our GEMM's panels are split at each call) and shares them with the helper; its greedy tokens are transformers'.
    One with a team packs them whole."""
    from tests.llm.reference import collect, make_engine, reference_generate, request_for

    inp, ref = request_for(checkpoint, reference, vision, case, seed=5, prefix=[11, 12, 13], max_tokens=20)
    engine = make_engine(model, reference, cpu_threads=1)
    chunks = lambda: {len(m.packed) for m in model.modules() if isinstance(m, Linear)}  # noqa: E731
    shared = 1 if cpu_kernels.panels_for(model.lm_head.weight) else cpu_kernels.SHARE_CHUNKS  # panels: split per call
    assert cpu_kernels.helper_on() and shared in chunks()
    offered = cpu_kernels.helper_stats()[0]
    try:
        ours, _ = asyncio.run(collect(engine, inp))
    finally:
        engine.close()
    assert cpu_kernels.helper_stats()[0] > offered
    assert ours == reference_generate(reference, ref, max_new_tokens=20)
    make_engine(model, reference, cpu_threads=2).close()
    assert chunks() == {1}


_EXITS = """
import threading, torch
from llm.model import cpu_kernels
from llm.model.layers import Linear, pack_linears
from tests.llm.test_helper_thread import _problem
cpu_kernels.load()
def work():  # an engine's worker thread: it starts the helper, shares calls, and ends before the interpreter does
    cpu_kernels.use_helper(True)
    args = _problem(torch.float32)
    w = torch.randn(1024, 512)
    packed = cpu_kernels.pack_chunks(w)
    for _ in range(5):
        cpu_kernels.paged_decode_cpu(*args)
        cpu_kernels.linear(torch.randn(4, 512), w, None, packed)
t = threading.Thread(target=work)
t.start()
t.join()
"""


@pytest.mark.slow  # three fresh interpreters (~11 s)
def test_the_process_exits_cleanly_whatever_the_helper_holds(kernels):
    # Seen before callers kept their jobs: the helper dropped a job's last tensor reference while the interpreter shut
    # down, torch's hand-back of the tensor's Python object ended the thread, and the process aborted (std::terminate)
    # in 2 of 3 runs of this script.
    root = Path(__file__).parents[2]
    runs = [subprocess.Popen([sys.executable, "-c", _EXITS], cwd=root, stderr=subprocess.PIPE) for _ in range(3)]
    for run in runs:
        _, err = run.communicate(timeout=120)
        assert run.returncode == 0, err.decode()[-2000:]
