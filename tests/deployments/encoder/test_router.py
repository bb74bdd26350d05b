"""The Encoder request router: the next image goes to the replica with less pending cost (not fewer requests), the
images of one request spread, a finished call gives its cost back, and a choice never sent lapses."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from deployments.encoder.router import CostRouter, PendingCost, call_cost, rank_by_cost

ENCODER_ID = DeploymentID(name="Encoder", app_name="vlm")


@dataclass
class FakeReplica:
    """What the router reads of a RunningReplica."""

    replica_id: ReplicaID
    max_ongoing_requests: int = 16


class FakeResult:
    """What the router reads of a ReplicaResult: its done-callbacks, run when the test says the call ended."""

    def __init__(self):
        self.callbacks = []

    def add_done_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def finish(self) -> None:
        for callback in self.callbacks:
            callback(None)


def _replicas(n: int) -> list[FakeReplica]:
    return [FakeReplica(ReplicaID(f"replica-{i}", ENCODER_ID)) for i in range(n)]


def _call(cost: float | None) -> PendingRequest:
    """An encode call; every image of one chat request shares its internal_request_id ("r")."""
    return PendingRequest(
        args=[b"image bytes", "key"],
        kwargs={} if cost is None else {"cost": cost},
        metadata=RequestMetadata(request_id="r", internal_request_id="r", call_method="encode"),
    )


def _router(seed: int = 0, **kwargs) -> CostRouter:
    router = CostRouter(deployment_id=ENCODER_ID, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(seed=seed, **kwargs)
    return router


def _queue(router: CostRouter, call: PendingRequest) -> None:
    router._pending_requests_to_fulfill.append(call)
    router._add_pending_request_to_indices(call)


async def _route(router: CostRouter, call: PendingRequest, replicas) -> FakeReplica:
    """Serve's steps for one call: choose, the first rank's replica is taken (none is full here), fulfil."""
    _queue(router, call)
    ranks = await router.choose_replicas(replicas, call)
    router._fulfill_next_pending_request(ranks[0][0], call.metadata)
    return call.future.result()


def test_the_next_image_goes_to_the_replica_with_less_pending_cost():
    """One big image in flight on one replica, then small ones: all go to the other, though it has more requests
    (power of two choices on request counts would send every second one behind the big image)."""

    async def main():
        router, replicas = _router(), _replicas(2)
        big = await _route(router, _call(500.0), replicas)
        other = next(r for r in replicas if r is not big)
        assert [await _route(router, _call(2.0), replicas) for _ in range(5)] == [other] * 5
        assert router.pending_cost.of([big.replica_id, other.replica_id]) == {
            big.replica_id: 500.0,
            other.replica_id: 10.0,
        }

    asyncio.run(main())


def test_the_images_of_one_request_spread_over_the_replicas():
    """Equal images of one request (one internal_request_id): each gets its own replica, and they alternate,
    because each choice already counts the ones before it (before any was sent)."""

    async def main():
        router, replicas = _router(), _replicas(2)
        calls = [_call(8.0) for _ in range(4)]
        chosen = [await _route(router, c, replicas) for c in calls]
        assert all(c.future.done() for c in calls)
        assert chosen[0] is not chosen[1] and chosen[2] is not chosen[3]
        assert {r.replica_id for r in chosen} == {r.replica_id for r in replicas}

    asyncio.run(main())


def test_chunks_chosen_before_any_is_taken_still_spread():
    """With its queue-length cache cold (new replicas, or 10 s idle), Serve chooses for every chunk of a video before
    it takes a replica for any (it probes the chosen one first, an await): the choices still count each other, and
    alternate. Eight seeds: chance alone would alternate in all of them once in 65536 times."""

    async def main(seed: int) -> list[FakeReplica]:
        router, replicas = _router(seed), _replicas(2)
        calls = [_call(8.0) for _ in range(4)]
        for call in calls:
            _queue(router, call)
        ranks = [await router.choose_replicas(replicas, call) for call in calls]  # all chosen, none taken yet
        for call, rank in zip(calls, ranks, strict=True):
            router._fulfill_next_pending_request(rank[0][0], call.metadata)
        return [call.future.result() for call in calls]

    for seed in range(8):
        chosen = asyncio.run(main(seed))
        assert chosen[0] is not chosen[1] and chosen[2] is not chosen[3], seed


def test_a_finished_call_gives_its_cost_back():
    async def main():
        router, replicas = _router(), _replicas(2)
        call = _call(50.0)
        replica = await _route(router, call, replicas)
        result = FakeResult()
        router.on_request_routed(call, replica.replica_id, result)  # the replica took it
        assert router.pending_cost.of([replica.replica_id])[replica.replica_id] == 50.0
        result.finish()
        assert router.pending_cost.of([replica.replica_id])[replica.replica_id] == 0.0

    asyncio.run(main())


def test_a_choice_never_sent_lapses_and_a_refused_call_moves():
    now = [0.0]
    pending = PendingCost(unsent_ttl_s=10.0, clock=lambda: now[0])
    a, b = (r.replica_id for r in _replicas(2))
    sent, unsent, refused = object(), object(), object()
    pending.reserve(sent, a, 1.0)
    pending.sent(sent)
    pending.reserve(unsent, a, 2.0)
    pending.reserve(refused, a, 4.0)
    pending.reserve(refused, b, 4.0)  # a refused it; chosen again, b
    assert pending.of([a, b]) == {a: 3.0, b: 4.0}
    now[0] = 11.0
    assert pending.of([a, b]) == {a: 1.0, b: 0.0}  # a call that runs long stays; choices never sent lapse


def test_calls_without_a_cost_go_to_the_least_loaded():
    async def main():
        router, replicas = _router(), _replicas(3)
        assert call_cost(_call(None)) is None and call_cost(None) is None
        assert await router.choose_replicas(replicas, _call(None)) == [replicas]

    asyncio.run(main())


def test_two_of_many_are_drawn_and_the_cheaper_goes_first():
    replicas = _replicas(5)
    pending = {r.replica_id: float(i) for i, r in enumerate(replicas)}
    rng = random.Random(0)
    drawn = [rank_by_cost(replicas, pending, rng) for _ in range(200)]
    assert all(len(d) == 2 and pending[d[0][0].replica_id] < pending[d[1][0].replica_id] for d in drawn)
    assert {d[0][0].replica_id for d in drawn} == {r.replica_id for r in replicas[:4]}  # the dearest never first
    assert rank_by_cost(replicas[:1], pending, rng) == [replicas[:1]]
