"""Embedding cache deployment: one replica that all encoder replicas share; a restart only costs misses."""

from __future__ import annotations

from typing import Any

import torch
from ray import serve

from encoders.cache import EmbeddingLRU
from schemas import DRAIN_POLL_S, AppArgs
from schemas.metrics import heap_census
from schemas.transfer import send_tensors_out_of_band


@serve.deployment(
    name="EmbeddingCache",
    num_replicas=1,
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=1024,
    graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
)
class EmbeddingCache:
    def __init__(self, args: dict[str, Any]):
        send_tensors_out_of_band()  # hits go back to encoders as views of the object store, not pickled copies
        self.lru = EmbeddingLRU(int(AppArgs.model_validate(args).encoder.cache_gib * (1 << 30)))

    # NOTE: async methods run on the replica's one event loop, so the LRU needs no lock.
    async def get(self, key: str) -> torch.Tensor | None:
        return self.lru.get(key)

    async def put(self, key: str, embeds: torch.Tensor) -> None:
        # NOTE: a copy in this process's memory: `embeds` is a view of an object the calling encoder owns.
        self.lru.put(key, embeds.clone())

    async def stats(self) -> dict[str, int]:
        return self.lru.stats()

    async def heap(self) -> dict[str, Any]:
        return heap_census()
