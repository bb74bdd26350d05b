"""Ray Serve's private APIs that this project relies on (Ray 2.60), all of them here, each with a test of what it
relies on in tests/deployments/test_ray_private.py: a Ray upgrade that changes one fails that test, not production.
Ray has no public API for any of them:
- `object_ref`: a handle call's result as an ObjectRef that the caller owns and can hold (the ingress's embedding
  cache) and hand to another call. Serve resolves a DeploymentResponse passed as an argument, but only at the top
  level of the arguments, and nothing then holds the result;
- `assigned`: wait until a replica took a streaming call, before its first item (the ingress's routing timeout);
- `OwnCallMixin`: the request routers' hook that hands a chosen replica to its own call;
- `prestart_workers`: ask this node's raylet for idle worker processes, kept alive, that the next actor started here
  takes instead of a new process (the raylet's `PrestartWorkers` RPC; Ray calls it itself only for tasks waiting);
  `idle_workers` lists them (by the title Ray gives an idle worker's process), those of one node by their parent,
  its raylet (`my_raylet`).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import ray
from ray import ObjectRef
from ray.serve.handle import DeploymentResponse, DeploymentResponseGenerator
from ray.serve.request_router import PendingRequest, RunningReplica


async def object_ref(response: DeploymentResponse) -> ObjectRef:
    """The ObjectRef of a handle call's result, owned by the caller (it outlives the replica that made it)."""
    return await response._to_object_ref()


async def assigned(call: DeploymentResponseGenerator | Any) -> None:
    """Returns once Serve's router has given a streaming call to a replica (before the replica yields anything)."""
    await call._fetch_future_result_async()


class OwnCallMixin:
    """A replica chosen for a call goes to that very call (mixed into both routers, before `RequestRouter`).

    NOTE: Serve matches by `internal_request_id`, which every call made while one ingress request is handled
    inherits: the n choices of one chat request share it, and so do the encoder calls of its images; only the first
    is indexed under it, and the base class would leave the others waiting forever (the `n=3` request hung). Each
    call has its own metadata object, so match that; Serve's own matching stays the fallback. Overrides a private
    hook of Ray 2.60 and uses its helpers. A call can be cancelled between the check that it waits and the answer:
    when a client leaves, Serve cancels its request's calls from the replica's own event loop, and this router runs
    in a loop of its own (another thread). That call needs no replica; Serve's own version logged the error,
    "Unexpected error in _fulfill_pending_requests", a few times per 10,000 requests in the soak."""

    def on_chosen(self, pending: PendingRequest, replica: RunningReplica) -> None:
        """Called once a replica is chosen for `pending` (before it is sent there); a router's own bookkeeping."""

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None) -> None:
        for pending in self._pending_requests_to_fulfill:
            if pending.metadata is request_metadata and not pending.future.done():
                self._cancel_routing_task_for_pending_request(pending)
                self._record_queue_wait_time(pending)
                self._remove_pending_request_from_indices(pending)
                try:
                    pending.future.set_result(replica)
                except asyncio.InvalidStateError:  # NOTE: cancelled meanwhile, from another thread (above)
                    return
                self.on_chosen(pending, replica)
                return
        super()._fulfill_next_pending_request(replica, request_metadata)


def prestart_workers(count: int, keep_alive_s: int) -> None:
    """Starts `count` idle Python workers on this process's node, kept for `keep_alive_s` seconds above the
    raylet's idle limit: the next actors placed here (a Serve replica of any job whose runtime_env is the cluster's
    default) take them, ready in about 0.1 s instead of a new process's 1-3 s, with the cluster's
    `RAY_preload_python_modules` imported (Makefile `WORKER_ENV`). Each call starts `count` more; nothing counts the
    idle ones. Raises on an RPC error (grpc.RpcError)."""
    from ray._private.grpc_utils import init_grpc_channel  # the cluster's TLS and token authentication
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc

    here = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == here)
    channel = init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
    try:
        request = node_manager_pb2.PrestartWorkersRequest(
            language=common_pb2.PYTHON, num_workers=count, keep_alive_duration_secs=keep_alive_s
        )
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=10)
    finally:
        channel.close()


IDLE_TITLE = b"ray::IDLE"  # the process title Ray sets on a worker while it waits for work


RAYLET = b"raylet"  # the raylet's process name (/proc/PID/comm): it starts its node's worker processes


def idle_workers(proc: Path = Path("/proc"), raylet: int | None = None) -> set[int]:
    """The PIDs of the Ray worker processes that wait for work, on this machine (none where there is no /proc); with
    `raylet`, only those that raylet started (its node's, where one machine runs several nodes)."""
    out = set()
    for cmdline in proc.glob("[0-9]*/cmdline"):
        try:
            if cmdline.read_bytes().startswith(IDLE_TITLE) and (raylet is None or _parent(cmdline.parent) == raylet):
                out.add(int(cmdline.parent.name))
        except OSError:  # the process ended meanwhile
            pass
    return out


def my_raylet(proc: Path = Path("/proc"), pid: int | None = None) -> int | None:
    """The PID of the raylet that started this worker process (`pid`'s parent), or None where the parent is not a
    raylet (then `idle_workers` counts the machine's)."""
    try:
        parent = _parent(proc / str(pid if pid is not None else os.getpid()))
        return parent if (proc / str(parent) / "comm").read_bytes().strip() == RAYLET else None
    except (OSError, ValueError, IndexError):  # no /proc, or not Linux's
        return None


def _parent(process: Path) -> int:
    """A process's parent PID, from /proc/PID/stat (after its name in parentheses, which may hold any character)."""
    return int((process / "stat").read_bytes().rpartition(b")")[2].split()[1])
