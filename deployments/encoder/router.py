"""Request router of the Encoder replicas: power of two choices on pending cost (encoder work sent and not finished),
not on ongoing request counts, so that a 2048x2048 scan weighs what it costs and not what a thumbnail does."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.ray_private import OwnCallMixin

# Power of two choices: Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing" (2001), as Serve's
# own PowerOfTwoChoicesRequestRouter samples; what is compared here is the work pending, not the requests.

COST_KWARG = "cost"  # a call routed on cost names its cost (encoders/cost.py, GFLOP) in this keyword argument


def call_cost(pending: PendingRequest | None) -> float | None:
    """The cost of a unit of encoder work (an image, a video chunk): its `cost=` keyword; None for other calls."""
    if pending is None:
        return None
    cost = pending.kwargs.get(COST_KWARG)
    return None if cost is None else float(cost)


@dataclass(slots=True)
class _Entry:
    call: Any  # the call's metadata object: one per call, held so that its id() is not reused while here
    replica_id: ReplicaID
    cost: float
    chosen_at: float
    sent: bool = False


class PendingCost:
    """The cost this router sent to each replica that has not finished yet: reserved when a replica is chosen for a
    call, so that the next call (the next image of the same request) already sees it; kept while the call runs;
    released when it ends. A choice that was never sent (the replica refused it, the caller left) lapses after
    `unsent_ttl_s`; a refused call chosen again moves its reservation. Thread-safe: Serve runs done-callbacks on
    another thread."""

    def __init__(self, unsent_ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.unsent_ttl_s, self.clock = unsent_ttl_s, clock
        self._entries: dict[int, _Entry] = {}
        self._lock = threading.Lock()

    def reserve(self, call: Any, replica_id: ReplicaID, cost: float) -> None:
        with self._lock:
            self._entries[id(call)] = _Entry(call, replica_id, cost, self.clock())

    def sent(self, call: Any) -> bool:
        """The replica took the call: its cost stays until `release`. False if it holds no reservation."""
        with self._lock:
            entry = self._entries.get(id(call))
            if entry is None or entry.call is not call:
                return False
            entry.sent = True
            return True

    def release(self, call: Any) -> None:
        with self._lock:
            entry = self._entries.get(id(call))
            if entry is not None and entry.call is call:
                del self._entries[id(call)]

    def of(self, replica_ids: Sequence[ReplicaID]) -> dict[ReplicaID, float]:
        """Pending cost per replica (0 for one with none)."""
        now, out = self.clock(), dict.fromkeys(replica_ids, 0.0)
        with self._lock:
            for key, e in list(self._entries.items()):
                if not e.sent and now - e.chosen_at > self.unsent_ttl_s:
                    del self._entries[key]
                elif e.replica_id in out:
                    out[e.replica_id] += e.cost
        return out


def rank_by_cost(
    replicas: Sequence[RunningReplica], pending: dict[ReplicaID, float], rng: random.Random
) -> list[list[RunningReplica]]:
    """Two replicas drawn at random (all of them if two or fewer), the one with less pending cost first, each its own
    rank: Serve sends to the first that is not full. Ties go either way (the draw is in random order)."""
    two = rng.sample(list(replicas), min(2, len(replicas)))
    return [[r] for r in sorted(two, key=lambda r: pending[r.replica_id])]


class CostRouter(OwnCallMixin, RequestRouter):
    """Serve's `request_router_class` for the Encoder deployment. Calls that name a cost (`cost=`) go by power of two
    choices on pending cost; others (`stats`) to the least loaded replica, as Serve would send them.

    NOTE: each caller's router counts the cost it sent itself (Serve's own queue-length cache does the same with
    request counts): exact with one ingress replica; with several, each balances its own share of the traffic."""

    def initialize_state(self, unsent_ttl_s: float = 10.0, seed: int | None = None) -> None:
        self.pending_cost = PendingCost(unsent_ttl_s)
        self.rng = random.Random(seed)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:  # NOTE: after all ranks refused, back off; without it a full tier spins
            pending_request.routing_context.should_backoff = True
        if (cost := call_cost(pending_request)) is None or not candidate_replicas:
            return [candidate_replicas]
        available = self.select_available_replicas(candidate_replicas) or candidate_replicas
        self.pending_cost.release(pending_request.metadata)  # chosen again (its replica was full): not its own load
        ranks = rank_by_cost(available, self.pending_cost.of([r.replica_id for r in available]), self.rng)
        # NOTE: reserved on the first rank now, not only once Serve takes a replica (on_chosen, which moves it if
        # Serve takes another): with its queue-length cache cold (new replicas, or 10 s idle), Serve probes the
        # replica first, an await, and the other chunks of the same video are chosen meanwhile; without this they
        # all saw no load and went where chance sent them, at times all to one replica.
        self.pending_cost.reserve(pending_request.metadata, ranks[0][0].replica_id, cost)
        return ranks

    def on_chosen(self, pending: PendingRequest, replica: RunningReplica) -> None:
        if (cost := call_cost(pending)) is not None:
            self.pending_cost.reserve(pending.metadata, replica.replica_id, cost)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        """The replica took the call: its cost stays pending until the call ends, however it ends."""
        call = pending_request.metadata
        if self.pending_cost.sent(call):
            result.add_done_callback(lambda _: self.pending_cost.release(call))


__all__ = ["COST_KWARG", "CostRouter", "PendingCost", "call_cost", "rank_by_cost"]
