"""The Encoder replica's class without Serve: a call's images come back in order, a bad one as its error in its place
(the others of the call are good); the CPU threads it encodes on; and the out-of-band form embeddings travel in."""

from __future__ import annotations

import asyncio
import pickle
import subprocess
import sys
import time
import uuid

import pytest
import torch

from demo.inputs import image_bytes, make_image
from deployments.encoder import server
from deployments.encoder.autoscaling import ARRIVING_COST, MEAN_COST, PENDING_COST, TARGET_COST, WINDOW_S
from deployments.encoder.server import WARM_KEEP_ALIVE_S, Encoder
from deployments.transfer import _from_numpy, _to_numpy
from encoders import Qwen2VLVisionEncoder
from schemas import InvalidRequest


def test_a_call_returns_each_images_embedding_and_a_bad_one_as_its_error(checkpoint):
    encoder = Encoder.func_or_class({"model": str(checkpoint), "encoder": {"startup_check": False}})
    small, big = image_bytes(make_image(70, 50, seed=3)), image_bytes(make_image(140, 84, seed=4))

    async def run():
        alone = [await encoder.encode([data]) for data in (small, big)]
        together = await encoder.encode([small, big[: len(big) // 2], big], cost=2.0)
        return alone, together

    alone, (first, bad, last) = asyncio.run(run())
    torch.testing.assert_close(first, alone[0][0], rtol=1e-5, atol=1e-3)  # batched together: float noise only
    torch.testing.assert_close(last, alone[1][0], rtol=1e-5, atol=1e-3)
    assert first.shape[0] < last.shape[0]
    assert isinstance(bad, InvalidRequest) and "could not be decoded" in bad.message
    assert encoder.pending_cost == 0  # the call's cost counted while it ran, not after


def test_the_replica_reports_the_costs_the_policy_reads(checkpoint):
    """After a call of cost 5: nothing pending; what arrived over the meter's window, per target delay, over the
    target utilization (arriving at that share of a replica's rate is one replica's worth); its mean; the target."""
    opts = {"startup_check": False, "target_cost_per_replica": 3.0, "target_queue_delay_s": 2.0}
    opts["target_utilization"] = 0.5
    encoder = Encoder.func_or_class({"model": str(checkpoint), "encoder": opts})

    async def run():
        await encoder.encode([image_bytes(make_image(70, 50, seed=3))], cost=5.0)
        return await encoder.record_autoscaling_stats()

    arriving = 5.0 / WINDOW_S * 2.0 / 0.5
    assert asyncio.run(run()) == {PENDING_COST: 0.0, ARRIVING_COST: arriving, MEAN_COST: 5.0, TARGET_COST: 3.0}


@pytest.mark.parametrize(("warm", "idle", "started"), [(2, 0, 2), (2, 1, 1), (2, 3, None), (0, 0, None)])
def test_a_replica_tops_its_node_up_to_its_warm_workers(checkpoint, monkeypatch, warm, idle, started):
    """Once ready, a replica leaves `warm_workers` idle processes on its node, less those already idle there (those
    its raylet started: one machine may run several nodes)."""
    calls, counted = [], []
    monkeypatch.setattr(server, "this_replica", _a_replica())
    monkeypatch.setattr(server, "my_raylet", lambda: 4242)
    monkeypatch.setattr(server, "idle_workers", lambda raylet: counted.append(raylet) or set(range(idle)))
    monkeypatch.setattr(server, "prestart_workers", lambda count, keep_s: calls.append((count, keep_s)))
    Encoder.func_or_class({"model": str(checkpoint), "encoder": {"startup_check": False, "warm_workers": warm}})
    deadline = time.monotonic() + 10
    while started and not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert calls == ([(started, WARM_KEEP_ALIVE_S)] if started else [])
    assert set(counted) <= {4242}


def test_a_replica_tops_its_node_up_again_once_a_start_took_its_warm_workers(checkpoint, monkeypatch):
    calls, idle = [], iter([2, 2, 0])
    monkeypatch.setattr(server, "WARM_EVERY_S", 0.01)
    monkeypatch.setattr(server, "this_replica", _a_replica())
    monkeypatch.setattr(server, "idle_workers", lambda raylet: set(range(next(idle, 2))))
    monkeypatch.setattr(server, "prestart_workers", lambda count, keep_s: calls.append(count))
    Encoder.func_or_class({"model": str(checkpoint), "encoder": {"startup_check": False, "warm_workers": 2}})
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert calls == [2]  # the third look found none: two more, and none again while two wait


def test_a_replica_tops_up_only_while_it_has_no_image_to_encode(checkpoint, monkeypatch):
    calls = []
    monkeypatch.setattr(server, "WARM_EVERY_S", 0.01)
    monkeypatch.setattr(server, "this_replica", _a_replica())
    monkeypatch.setattr(server, "idle_workers", lambda raylet: {1, 2})
    monkeypatch.setattr(server, "prestart_workers", lambda count, keep_s: calls.append(count))
    encoder = Encoder.func_or_class({"model": str(checkpoint), "encoder": {"startup_check": False, "warm_workers": 2}})
    encoder.pending_cost = 5.0  # images queued here
    monkeypatch.setattr(server, "idle_workers", lambda raylet: set())  # a start took both
    time.sleep(0.2)
    assert calls == []
    encoder.pending_cost = 0.0
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls[:1] == [2]


def test_a_replica_that_cannot_leave_warm_workers_serves_all_the_same(checkpoint, monkeypatch, caplog):
    tries = []

    def fails(count, keep_s):
        tries.append(count)
        raise RuntimeError("raylet unavailable")

    monkeypatch.setattr(server, "WARM_EVERY_S", 0.01)
    monkeypatch.setattr(server, "this_replica", _a_replica())
    monkeypatch.setattr(server, "idle_workers", lambda raylet: set())
    monkeypatch.setattr(server, "prestart_workers", fails)
    encoder = Encoder.func_or_class({"model": str(checkpoint), "encoder": {"startup_check": False}})
    deadline = time.monotonic() + 10
    while len(tries) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "warm worker" in r.getMessage()]
    assert len(tries) >= 3 and len(warnings) == 1  # said once, not every few seconds
    assert "could not leave warm worker processes (RuntimeError: raylet unavailable)" in warnings[0].getMessage()
    out = asyncio.run(encoder.encode([image_bytes(make_image(70, 50, seed=3))]))
    assert isinstance(out[0], torch.Tensor)


def _a_replica():
    """`this_replica` as in a replica of its own: a replica's warm-worker thread runs while it is that replica, so
    one a test left behind stops at the next test's."""
    name = f"replica-{uuid.uuid4().hex[:8]}"
    return lambda: name


class _Threads(Qwen2VLVisionEncoder):
    seen: list[int] = []  # torch's threads in the thread that ran each forward

    def forward(self, batch):
        _Threads.seen.append(torch.get_num_threads())
        return super().forward(batch)


def test_encoder_cpu_threads_are_the_threads_its_forward_runs_on(checkpoint):
    """`encoder.cpu_threads`: the replica's ViT runs on that many threads, in the worker thread that encodes (a
    thread started after the replica was made), not only in the replica's own."""
    before, _Threads.seen = torch.get_num_threads(), []
    args = {"model": str(checkpoint), "encoder": {"startup_check": False, "cpu_threads": before + 1}}
    try:
        encoder = Encoder.func_or_class(args, model_factory=_Threads)
        asyncio.run(encoder.encode([image_bytes(make_image(70, 50, seed=3))]))
    finally:
        torch.set_num_threads(before)  # process-wide: the other tests of this worker keep theirs
    assert _Threads.seen == [before + 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_out_of_band_tensor_round_trip(dtype):
    """What deployments/transfer.py sends for an embedding comes back equal, dtype and shape included."""
    embeds = torch.randn(37, 24).to(dtype)[:, 4:20]  # not contiguous
    payload = _to_numpy(embeds)
    back = _from_numpy(pickle.loads(pickle.dumps(payload, protocol=5)))
    assert back.dtype == dtype and back.shape == embeds.shape and back.equal(embeds)


def test_a_receiver_unpickles_an_embedding_with_the_light_transfer_module_alone():
    """The pickle of an embedding names its deserializer by module: a receiver (the LLM replica) imports that module,
    and no more than torch, numpy and Ray with it, not the Encoder deployment's imports."""
    code = (
        "import sys, pickle, ray, torch\n"
        "from deployments.transfer import _from_numpy, _to_numpy\n"
        "blob = pickle.dumps((_from_numpy, _to_numpy(torch.ones(2, 3))))\n"
        "for name in [m for m in sys.modules if m.startswith(('deployments', 'encoders', 'llm'))]:\n"
        "    del sys.modules[name]\n"
        "load, payload = pickle.loads(blob)\n"
        "assert load(payload).sum() == 6\n"
        "print(sorted(m for m in sys.modules if m.startswith(('deployments', 'encoders', 'llm', 'transformers'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['deployments', 'deployments.transfer']"
