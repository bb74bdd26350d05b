"""The engine's worker thread gets its own CPU threads while the rest of the process keeps one (engine/threads.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from llm.engine.threads import CoresFollowLoad, _loaded_library, set_thread_intra_op_threads
from tests.llm.reference import collect, make_engine, request_for
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


def _generate_seeing_threads(engine, max_tokens: int) -> tuple[list, list[int]]:
    """One generation's chunks, and the torch threads the engine's worker had at each of its steps."""
    seen = []
    engine.on_step = lambda chunks: seen.append(torch.get_num_threads())

    async def run():
        return [c async for c in engine.generate(_seq([5, 6, 7], max_tokens=max_tokens))]

    return asyncio.run(run()), seen


def test_the_engine_steps_on_its_configured_threads(one_thread_process_wide, model, reference):
    engine = make_engine(model, reference, cpu_threads=2)
    chunks, seen = _generate_seeing_threads(engine, max_tokens=3)
    assert sum(len(c.token_ids) for c in chunks) == 3
    assert seen and set(seen) == {2}
    assert torch.get_num_threads() == 1


class _Node:
    """/proc/stat and /proc/self/stat of a 2-CPU node, advanced by hand: `tick(others, own)` in cores for 1 s."""

    HZ = 100

    def __init__(self):
        self.busy, self.idle, self.own = [0, 0], [0, 0], 0

    def tick(self, others: float, own: float) -> None:
        for cpu in (0, 1):
            used = round((others + own) / 2 * self.HZ)
            self.busy[cpu] += used
            self.idle[cpu] += self.HZ - used
        self.own += round(own * self.HZ)

    def stat(self) -> str:
        lines = [f"cpu  {sum(self.busy)} 0 0 {sum(self.idle)} 0 0 0 0 0 0"]
        lines += [f"cpu{i} {self.busy[i]} 0 0 {self.idle[i]} 0 0 0 0 0 0" for i in (0, 1)]
        return "\n".join([*lines, "intr 1 2 3", "procs_running 1"])

    def self_stat(self) -> str:
        return f"42 (ray::Serve (LLM)) S 1 2 3 4 5 6 7 8 9 10 {self.own} 0 0 0 20 0"


def _follower(node: _Node, **kw) -> CoresFollowLoad:
    return CoresFollowLoad(
        1, 8, interval_s=1.0, cpus={0, 1}, read_stat=node.stat, read_self=node.self_stat, now=0.0, **kw
    )


def test_the_engine_takes_the_cores_the_others_leave_and_gives_them_back():
    node = _Node()
    cores = _follower(node)
    assert (cores.threads, cores.ceiling) == (1, 2)  # at most the CPUs it may run on
    t = 0.0
    for others, own, expected in [
        (0.1, 1.0, 2),  # the node was idle but for us: take the second core
        (0.3, 1.7, 2),  # a little work elsewhere: keep it (hysteresis)
        (0.8, 1.2, 1),  # the encoders got busy: give it back at once
        (0.3, 1.0, 1),  # not idle enough to take it again
        (0.0, 1.0, 2),
    ]:
        node.tick(others, own)
        t += 1.0
        assert cores.update(now=t) == expected, (others, own)
        assert cores.others == pytest.approx(others, abs=0.02)


def test_the_cores_an_encoder_held_for_the_engine_are_taken_when_its_images_arrive():
    """The last look saw the encoder busy (0.9 cores): one thread. Its images arrive: two at once, without waiting
    for the next look, which starts afresh and gives the core back if the others want it after all."""
    node = _Node()
    cores = _follower(node)
    node.tick(0.9, 1.0)
    assert cores.update(now=1.0) == 1
    node.tick(0.9, 1.0)  # the encoder's last batch, before the images arrive at t = 1.5
    cores.images_arrived(now=1.5)
    assert cores.update(now=1.6) == 2  # within the new window: no look yet
    node.tick(0.1, 1.9)
    assert cores.update(now=2.6) == 2  # the window after the images: the others idle
    assert cores.others == pytest.approx(0.1, abs=0.02)  # not the encoder's 0.9 before the images
    node.tick(0.9, 1.1)
    assert cores.update(now=3.6) == 1  # others want it after all: given back


def test_the_load_is_read_at_most_once_per_interval():
    node = _Node()
    cores = _follower(node)
    node.tick(0.0, 1.0)
    assert cores.update(now=-1.0) == 1  # before the first interval is over: no look
    assert cores.update(now=5.0) == 2


def test_the_real_proc_files_parse():
    cores = CoresFollowLoad(1, 2, interval_s=0.0)
    sum(i * i for i in range(200_000))  # some CPU time of our own
    assert cores.update() in (1, 2)
    assert 0.0 <= cores.others <= len(cores.cpus)


def test_the_engine_steps_on_the_threads_the_load_leaves(one_thread_process_wide, model, reference, monkeypatch):
    plan = iter([2, 2, 1, 2, 2, 2, 2, 2, 2, 2])

    class Scripted(CoresFollowLoad):
        def __init__(self, floor, ceiling):
            self.threads, self.floor, self.ceiling = floor, floor, ceiling

        def update(self, now=None):
            self.threads = next(plan, 2)
            return self.threads

    monkeypatch.setattr("llm.engine.threads.CoresFollowLoad", Scripted)
    engine = make_engine(model, reference, cpu_threads=1, cpu_threads_max=2, cpu_threads_max_rows=0)
    _, seen = _generate_seeing_threads(engine, max_tokens=4)
    assert seen[:4] == [2, 2, 1, 2]
    assert engine.stats()["cpu_thread_changes"] == 3
    assert torch.get_num_threads() == 1  # the test's thread is untouched


class _Idle(CoresFollowLoad):
    """An idle node: the worker may take its ceiling at every look."""

    def __init__(self, floor, ceiling):
        self.threads, self.floor, self.ceiling = ceiling, floor, ceiling

    def images_arrived(self, now=None):
        self.threads = self.ceiling

    def update(self, now=None):
        return self.threads


class _EncoderBusy(_Idle):
    """A node whose every look saw an encoder at work: the floor, unless the engine is told its images are here."""

    def __init__(self, floor, ceiling):
        super().__init__(floor, ceiling)
        self.threads = floor


def test_only_steps_of_many_rows_take_the_cores_the_load_leaves(one_thread_process_wide, model, reference, monkeypatch):
    """A prefill chunk of cpu_threads_max_rows rows or more gets what the load leaves; the decode steps after it,
    one row each, stay on cpu_threads, though the node is idle."""
    monkeypatch.setattr("llm.engine.threads.CoresFollowLoad", _Idle)
    engine = make_engine(model, reference, cpu_threads=1, cpu_threads_max=2, cpu_threads_max_rows=3)
    _, seen = _generate_seeing_threads(engine, max_tokens=4)  # a prompt of 3 tokens, then 3 decode steps
    assert seen == [2, 1, 1, 1]
    assert engine.stats()["cpu_thread_changes"] == 2
    engine = make_engine(model, reference, cpu_threads=1, cpu_threads_max=2, cpu_threads_max_rows=4)
    assert _generate_seeing_threads(engine, max_tokens=4)[1] == [1, 1, 1, 1]


def test_steps_keep_cpu_threads_while_an_encoder_works_for_the_engine(
    one_thread_process_wide, checkpoint, reference, model, vision, monkeypatch
):
    """Between an encoder's batches the node looks idle, yet taking its core delays the images the engine waits
    for: while one of its sequences awaits an image, every step runs on cpu_threads, and keeps to
    cpu_threads_max_rows rows (so that the step after the image arrives is not a long one on one thread); once it
    is there, the rest of the prefill, in one step, takes the core the encoder held, though the last look of the
    load saw it busy."""
    monkeypatch.setattr("llm.engine.threads.CoresFollowLoad", _EncoderBusy)
    prefix = [11, 12, 13, 14, 15, 16, 17]
    inp, _ = request_for(checkpoint, reference, vision, [(64, 48)], seed=1, prefix=prefix, max_tokens=2)
    engine = make_engine(model, reference, cpu_threads=1, cpu_threads_max=2, cpu_threads_max_rows=3)
    seen = []
    engine.on_step = lambda chunks: seen.append((torch.get_num_threads(), chunks[0].start, chunks[0].n))
    prompt = inp.request.prompt_token_ids
    image_at = prompt.index(reference.config.image_token_id)  # 8: the prefix and the vision start

    async def scenario():
        late = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(collect(engine, inp.replace(embeds=[late])))
        while sum(n for _, _, n in seen) < image_at:  # all the text before the image, while it is encoded
            await asyncio.sleep(0.01)
        late.set_result(inp.embeds[0])
        return await task

    asyncio.run(scenario())
    assert seen[:3] == [(1, 0, 3), (1, 3, 3), (1, 6, 2)]  # one thread, at most 3 rows a step
    assert seen[3] == (2, image_at, len(prompt) - image_at)  # the rest, the image there: two threads
    assert seen[4:] == [(1, len(prompt), 1)]  # the decode step: one
    engine.close()


def test_steps_keep_cpu_threads_while_a_colocated_encoder_encodes(
    one_thread_process_wide, model, reference, monkeypatch
):
    """A colocated encoder's threads are this process's own time, so the load looks idle while it encodes, and its
    images are encoded before their sequences reach the engine: the LLM replica counts them in `engine.encoding`,
    and meanwhile the steps keep to cpu_threads and cpu_threads_max_rows, as while an image is awaited."""
    monkeypatch.setattr("llm.engine.threads.CoresFollowLoad", _Idle)
    engine = make_engine(model, reference, cpu_threads=1, cpu_threads_max=2, cpu_threads_max_rows=3)
    engine.encoding = 1
    assert _generate_seeing_threads(engine, max_tokens=2)[1] == [1, 1]
    engine.encoding = 0
    assert _generate_seeing_threads(engine, max_tokens=2)[1] == [2, 1]
    engine.close()


def test_the_llm_replica_counts_its_colocated_encodes():
    """`engine.encoding` is up while the colocated encoder works on a request's images, and down after, failed or
    not."""
    from types import SimpleNamespace

    from deployments.llm.server import LLM
    from encoders.cache import EmbeddingLRU
    from schemas import MediaItem

    seen = []

    class Vision:
        async def encode(self, data: bytes) -> torch.Tensor:
            seen.append(replica.engine.encoding)
            if data == b"bad":
                raise RuntimeError("broken")
            return torch.zeros(1, 2)

    replica = SimpleNamespace(engine=SimpleNamespace(encoding=0), vision=Vision(), vision_cache=EmbeddingLRU(1 << 20))
    encode_here = LLM.func_or_class._encode_here
    items = lambda n: [MediaItem("", (1, 2, 2), 1, placeholder_id=0) for _ in range(n)]  # noqa: E731  (no key: never cached)
    assert len(asyncio.run(encode_here(replica, items(2), [b"a", b"b"]))) == 2
    assert seen == [1, 1] and replica.engine.encoding == 0
    with pytest.raises(RuntimeError, match="broken"):
        asyncio.run(encode_here(replica, items(1), [b"bad"]))
    assert replica.engine.encoding == 0
