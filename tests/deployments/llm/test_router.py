"""The LLM request router's choice: a key's home replica (the same from every ingress), the fallback to the
least loaded when the home is saturated, and an even spread of unrelated keys."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from deployments.llm.router import PrefixAffinityRouter, home_replica, rank_replicas, routing_key
from schemas import GenerateRequest, SamplingParams

LLM_ID = DeploymentID(name="LLM", app_name="vlm")


@dataclass
class FakeReplica:
    """What the router reads of a RunningReplica."""

    replica_id: ReplicaID
    max_ongoing_requests: int = 256


def _replicas(n: int, seed: int = 0) -> list[FakeReplica]:
    rng = random.Random(seed)
    return [FakeReplica(ReplicaID(f"{rng.getrandbits(64):016x}", LLM_ID)) for _ in range(n)]


def _keys(n: int) -> list[str]:
    return [f"conversation-{i}" for i in range(n)]


def test_a_key_has_one_home_whatever_the_candidates_order():
    replicas = _replicas(3)
    for key in _keys(50):
        orders = (replicas, replicas[::-1], replicas[1:] + replicas[:1])
        homes = {home_replica(key, order).replica_id for order in orders}
        assert len(homes) == 1


def test_a_replica_that_goes_moves_only_its_own_keys():
    replicas, keys = _replicas(3), _keys(300)
    before = {k: home_replica(k, replicas) for k in keys}
    after = {k: home_replica(k, replicas[:2]) for k in keys}
    assert all(after[k] is before[k] for k in keys if before[k] is not replicas[2])


@pytest.mark.parametrize("n", [2, 3])
def test_unrelated_keys_spread_evenly(n):
    keys = _keys(3000)
    for seed in range(3):  # replica ids are random in a real deployment
        counts = Counter(home_replica(k, _replicas(n, seed)).replica_id for k in keys)
        assert len(counts) == n and all(abs(c - len(keys) / n) < 0.1 * len(keys) / n for c in counts.values()), counts


def test_the_home_first_then_the_least_loaded_of_all():
    replicas = _replicas(2)
    home = home_replica("k", replicas)
    lens = {r.replica_id: 3 for r in replicas}
    assert rank_replicas("k", replicas, lens, max_imbalance=4) == [[home], replicas]
    assert rank_replicas("k", replicas, {}, max_imbalance=4) == [[home], replicas]  # queue lengths not known yet


def test_a_saturated_home_falls_back_to_the_least_loaded():
    replicas = _replicas(3)
    home = home_replica("k", replicas)
    lens = {r.replica_id: 1 for r in replicas} | {home.replica_id: 5}
    assert rank_replicas("k", replicas, lens, max_imbalance=4) == [replicas]  # 4 more than the least loaded
    assert rank_replicas("k", replicas, lens, max_imbalance=5) == [[home], replicas]


def test_no_key_or_one_replica_goes_to_the_least_loaded():
    replicas = _replicas(2)
    assert rank_replicas(None, replicas, {}, max_imbalance=4) == [replicas]
    assert rank_replicas("k", replicas[:1], {}, max_imbalance=4) == [replicas[:1]]


def _pending(req) -> PendingRequest:
    return PendingRequest(
        args=[req] if req is not None else [],
        kwargs={},
        metadata=RequestMetadata(request_id="r", internal_request_id="r", call_method="generate"),
    )


def _generate(key: str | None) -> GenerateRequest:
    return GenerateRequest(
        request_id="r", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=1), routing_key=key
    )


def test_the_router_reads_the_key_and_the_queue_lengths():
    async def main():
        router = PrefixAffinityRouter(
            deployment_id=LLM_ID, handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True
        )
        router.initialize_state(max_imbalance=2)
        replicas = _replicas(2)
        home = home_replica("k", replicas)
        other = next(r for r in replicas if r is not home)
        pending = _pending(_generate("k"))
        assert routing_key(pending) == "k" and routing_key(_pending(None)) is None
        assert await router.choose_replicas(replicas, pending) == [[home], replicas]
        assert pending.routing_context.should_backoff  # after every rank refused: back off, do not spin
        router.replica_queue_len_cache.update(home.replica_id, 2)
        router.replica_queue_len_cache.update(other.replica_id, 0)
        assert await router.choose_replicas(replicas, pending) == [replicas]
        assert await router.choose_replicas(replicas, _pending(_generate(None))) == [replicas]

    asyncio.run(main())


def test_max_imbalance_must_be_positive():
    router = PrefixAffinityRouter(deployment_id=LLM_ID, handle_source=DeploymentHandleSource.UNKNOWN)
    with pytest.raises(ValueError, match="at least 1, got 0"):
        router.initialize_state(max_imbalance=0)


def test_calls_that_share_an_internal_request_id_each_get_their_replica():
    """The n generate calls of one chat request inherit its internal_request_id; each must get the replica chosen
    for it (Serve's own matching by that id leaves all but one waiting forever)."""

    async def main():
        router = PrefixAffinityRouter(deployment_id=LLM_ID, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        calls = [_pending(_generate("k")) for _ in range(3)]  # same internal_request_id "r"
        for call in calls:
            router._pending_requests_to_fulfill.append(call)
            router._add_pending_request_to_indices(call)
        replicas = _replicas(3)
        for i in (1, 2, 0):
            router._fulfill_next_pending_request(replicas[i], calls[i].metadata)
            assert calls[i].future.done() and calls[i].future.result() is replicas[i]
        assert all(c.future.done() for c in calls)

    asyncio.run(main())


class _CancelledMeanwhile(asyncio.Future):
    """A call's future that another thread cancels just after the router saw it waiting."""

    def done(self) -> bool:
        was = super().done()
        if not was:
            self.cancel()
        return was


def test_a_call_cancelled_as_its_replica_is_chosen_is_dropped_quietly():
    """Serve cancels a leaving client's calls from another thread than the router's: one cancelled between the check
    and the answer raised InvalidStateError out of the router (an ERROR traceback per occurrence), and kept its
    place in the indices. Now it is dropped, and the next call still gets its replica."""

    async def main():
        router = PrefixAffinityRouter(deployment_id=LLM_ID, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        gone, next_call = _pending(_generate("k")), _pending(_generate("k"))
        gone.future = _CancelledMeanwhile()
        for call in (gone, next_call):
            router._pending_requests_to_fulfill.append(call)
            router._add_pending_request_to_indices(call)
        replicas = _replicas(2)
        router._fulfill_next_pending_request(replicas[0], gone.metadata)
        assert gone.future.cancelled()
        router._fulfill_next_pending_request(replicas[1], next_call.metadata)
        assert next_call.future.result() is replicas[1]

    asyncio.run(main())
