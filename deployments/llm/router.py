"""Request router of the LLM replicas: a conversation goes to the replica that holds its cached prefix."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.channel import ChannelOpen
from deployments.ray_private import OwnCallMixin

# The idea (route on the prompt's prefix, fall back to load balancing when the load is uneven) is Ray Serve LLM's
# PrefixCacheAffinityRouter (ray/llm/_internal/serve/routing_policies/prefix_aware); that one keeps a prefix tree
# in a shared actor. Ours hashes a key the ingress computed, so it needs no shared state at all.


def home_replica(key: str, replicas: Sequence[RunningReplica]) -> RunningReplica:
    """Rendezvous (highest-random-weight) hashing: every ingress replica picks the same home for a key without
    talking to the others, keys spread evenly, and a replica that comes or goes moves only the keys it wins or held."""

    def weight(r: RunningReplica) -> bytes:
        return hashlib.blake2b(f"{key}\0{r.replica_id.unique_id}".encode(), digest_size=8).digest()

    return max(replicas, key=weight)


def rank_replicas(
    key: str | None, replicas: Sequence[RunningReplica], queue_lens: Mapping[ReplicaID, int], max_imbalance: int
) -> list[list[RunningReplica]]:
    """Ranks to try, best first: the key's home alone, then all (Serve takes the least loaded of a rank that
    accepts). The home is skipped when it holds `max_imbalance` more requests than the least loaded replica;
    `queue_lens` has the known queue lengths (Serve's cache), an unknown one counts as not saturated."""
    everyone = list(replicas)
    if key is None or len(everyone) < 2:
        return [everyone]
    home = home_replica(key, everyone)
    home_len = queue_lens.get(home.replica_id)
    if home_len is not None and home_len - min(queue_lens.values()) >= max_imbalance:
        return [everyone]
    return [[home], everyone]


def pinned_replica(request: PendingRequest | None, replicas: Sequence[RunningReplica]) -> list[RunningReplica] | None:
    """A token channel (deployments/channel.py) names the replica it is for: that one alone, while it is there
    (else any: the replica that gets it refuses it, and the ingress opens it again when it needs it)."""
    if request is None or not request.args or not isinstance(request.args[0], ChannelOpen):
        return None
    return [r for r in replicas if r.replica_id.unique_id == request.args[0].replica_id] or list(replicas)


def routing_key(request: PendingRequest | None) -> str | None:
    """The `routing_key` of the call's first argument (a GenerateRequest); None for other calls."""
    if request is None or not request.args:
        return None
    return getattr(request.args[0], "routing_key", None)


class PrefixAffinityRouter(OwnCallMixin, RequestRouter):
    """Serve's `request_router_class` for the LLM deployment (`request_router_kwargs`: `max_imbalance`).

    NOTE: no FIFOMixin: it hands a replica found for one request to whichever request is first in line, which
    would send that one away from its own home. Each request here gets the replica chosen for it (OwnCallMixin)."""

    def initialize_state(self, max_imbalance: int = 8) -> None:
        if max_imbalance < 1:
            raise ValueError(f"max_imbalance must be at least 1, got {max_imbalance}")
        self.max_imbalance = max_imbalance

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:  # NOTE: after all ranks refused, back off; without it a full tier spins
            pending_request.routing_context.should_backoff = True
        if (pinned := pinned_replica(pending_request, candidate_replicas)) is not None:
            return [pinned]
        cache = self.replica_queue_len_cache
        queue_lens = {r.replica_id: n for r in candidate_replicas if (n := cache.get(r.replica_id)) is not None}
        return rank_replicas(routing_key(pending_request), candidate_replicas, queue_lens, self.max_imbalance)


__all__ = ["OwnCallMixin", "PrefixAffinityRouter", "home_replica", "pinned_replica", "rank_replicas", "routing_key"]
