"""The engine's worker thread gets its own CPU threads while the rest of the process keeps one (engine/threads.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from llm.engine.threads import _loaded_library, set_thread_intra_op_threads
from tests.llm.reference import make_engine
from tests.llm.test_engine import _seq


@pytest.fixture
def one_thread_process_wide():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_only_the_calling_thread_gets_the_threads(one_thread_process_wide):
    mkl = _loaded_library("libtorch_cpu")

    def worker():
        n = set_thread_intra_op_threads(3)
        return n, torch.get_num_threads(), mkl.mkl_get_max_threads() if mkl is not None else 3

    assert _in_thread(worker) == (3, 3, 3)  # OpenMP and MKL both
    assert torch.get_num_threads() == 1  # this thread, and a new one, keep the process-wide setting
    assert _in_thread(torch.get_num_threads) == 1
    if mkl is not None:
        assert mkl.mkl_get_max_threads() == 1


def test_the_engine_steps_on_its_configured_threads(one_thread_process_wide, model, reference):
    engine = make_engine(model, reference, cpu_threads=2)
    seen = []
    step = engine._step

    def spy(chunks):
        seen.append(torch.get_num_threads())
        return step(chunks)

    engine._step = spy

    async def run():
        return [c async for c in engine.generate(_seq([5, 6, 7], max_tokens=3))]

    chunks = asyncio.run(run())
    assert sum(len(c.token_ids) for c in chunks) == 3
    assert seen and set(seen) == {2}
    assert torch.get_num_threads() == 1
