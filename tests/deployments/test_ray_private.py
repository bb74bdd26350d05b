"""What deployments/ray_private.py relies on in Ray Serve's private API, one test each: a Ray upgrade that renames or
reshapes one fails here, naming it. (What each does is tested through the app: the embedding cache and the fan-out
hold `object_ref`s, the routing timeout waits on `assigned`, the n=3 request and the encoder calls of one request
each reach the replica chosen for them through `OwnCallMixin`; an Encoder replica's start in a warm process,
tests/deployments/test_encoder_autoscaling.py.)"""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
from pathlib import Path

from ray.serve.handle import DeploymentResponse, DeploymentResponseGenerator
from ray.serve.request_router import PendingRequest, RequestRouter

from deployments.encoder.router import CostRouter
from deployments.llm.router import PrefixAffinityRouter
from deployments.ray_private import IDLE_TITLE, OwnCallMixin, idle_workers, my_raylet, prestart_workers


def _params(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_a_deployment_response_gives_its_object_ref_to_await():
    assert inspect.iscoroutinefunction(DeploymentResponse._to_object_ref)
    assert _params(DeploymentResponse._to_object_ref)[:1] == ["self"]


def test_a_streaming_call_can_be_awaited_until_a_replica_takes_it():
    assert inspect.iscoroutinefunction(DeploymentResponseGenerator._fetch_future_result_async)


def test_the_routers_hook_and_the_helpers_it_uses_are_there():
    """OwnCallMixin overrides `_fulfill_next_pending_request(replica, request_metadata)` and walks the router's
    pending requests (their `metadata` and `future`) with the base class's own helpers."""
    assert _params(RequestRouter._fulfill_next_pending_request) == ["self", "replica", "request_metadata"]
    for helper in (
        "_cancel_routing_task_for_pending_request",
        "_record_queue_wait_time",
        "_remove_pending_request_from_indices",
    ):
        assert _params(getattr(RequestRouter, helper)) == ["self", "pending_request"], helper
    assert "self._pending_requests_to_fulfill" in inspect.getsource(RequestRouter.__init__)
    assert {"metadata", "future"} <= {f.name for f in dataclasses.fields(PendingRequest)}


def test_both_routers_take_the_hook_before_serves_own():
    for router in (PrefixAffinityRouter, CostRouter):
        assert router.__mro__.index(OwnCallMixin) < router.__mro__.index(RequestRouter), router.__name__
        assert router._fulfill_next_pending_request is OwnCallMixin._fulfill_next_pending_request


def test_the_routers_probe_timeout_is_worded_as_the_ingress_log_filter_expects():
    """deployments/errors.py's `_ProbeTimeouts` recognizes Serve's warning by its first words."""
    from ray.serve._private.request_router.request_router import RequestRouter as Base

    from deployments.errors import PROBE_TIMEOUT

    assert f'f"{PROBE_TIMEOUT}{{replica.replica_id}} "' in inspect.getsource(Base._probe_queue_lens)


def test_idle_workers_are_the_processes_titled_as_ray_titles_an_idle_worker(tmp_path):
    for pid, title in [(1, IDLE_TITLE + b"\0"), (2, b"ray::Encoder\0"), (3, IDLE_TITLE), (4, b"python\0-m\0")]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(title)
    (tmp_path / "self").mkdir()
    assert idle_workers(tmp_path) == {1, 3}
    assert idle_workers(tmp_path / "absent") == set()


def test_a_nodes_idle_workers_are_those_its_raylet_started(tmp_path):
    """Where one machine runs several nodes (the tests' and the bench's clusters), each raylet's idle workers are
    its children; a worker finds its raylet as its parent, when that is a raylet."""
    processes = [
        (10, 1, b"raylet", b"raylet"), (20, 1, b"raylet", b"raylet"), (11, 10, b"ray::IDLE", IDLE_TITLE),
        (12, 10, b"ray::Enc oder) x", b"ray::Encoder\0"), (21, 20, b"ray::IDLE", IDLE_TITLE),
        (22, 20, b"ray::IDLE", IDLE_TITLE), (30, 1, b"python", b"python\0"), (31, 30, b"python", b"x\0"),
    ]  # fmt: skip
    for pid, parent, comm, title in processes:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(title)
        (tmp_path / str(pid) / "comm").write_bytes(comm + b"\n")
        (tmp_path / str(pid) / "stat").write_bytes(b"%d (%s) S %d 0 0" % (pid, comm, parent))
    assert idle_workers(tmp_path, raylet=10) == {11}
    assert idle_workers(tmp_path, raylet=20) == {21, 22}
    assert idle_workers(tmp_path) == {11, 21, 22}
    assert my_raylet(tmp_path, pid=12) == 10 and my_raylet(tmp_path, pid=22) == 20
    assert my_raylet(tmp_path, pid=31) is None  # not started by a raylet: the machine's count
    assert my_raylet(tmp_path / "absent", pid=12) is None


def test_a_worker_finds_its_raylet(ray_serve):
    """In the running cluster: a worker process's parent is its node's raylet."""
    import ray

    @ray.remote(num_cpus=0)
    def raylet() -> int | None:
        return my_raylet()

    pid = ray.get(raylet.remote())
    assert pid is not None and Path(f"/proc/{pid}/comm").read_text().strip() == "raylet"


def test_a_prestarted_worker_is_where_the_next_actor_starts(ray_serve):
    """The raylet's PrestartWorkers RPC (token authentication on, as Ray 2.60 has it by default) starts an idle
    worker that Ray keeps above its idle limit, and a detached actor created next by another actor (as Serve's
    controller creates replicas) starts in an idle process, not a new one (in the session's cluster, other apps'
    Encoder replicas may have left idle processes too: Ray picks among them)."""
    import ray

    @ray.remote(num_cpus=0)
    class Pid:
        def pid(self) -> int:
            return os.getpid()

    @ray.remote(num_cpus=0)
    class Creator:
        def create(self) -> int:
            actor = Pid.options(lifetime="detached").remote()
            try:
                return ray.get(actor.pid.remote())
            finally:
                ray.kill(actor)

    creator = Creator.remote()
    try:
        ray.get(creator.__ray_ready__.remote(), timeout=60)
        before = idle_workers()
        prestart_workers(1, 60)
        deadline = time.monotonic() + 60
        while not (idle_workers() - before) and time.monotonic() < deadline:
            time.sleep(0.2)
        warm = idle_workers() - before
        assert warm, "no idle worker came up"
        time.sleep(2)  # longer than the raylet's idle-worker reaping (1 s): the keep-alive holds it
        idle = idle_workers()
        assert warm <= idle
        assert ray.get(creator.create.remote(), timeout=60) in idle  # an idle process: ours, or one left before it
    finally:
        ray.kill(creator)
