"""The colocated encoder's embedding cache: bounded by bytes, least recently used out first."""

from __future__ import annotations

import torch

from encoders import EmbeddingLRU


def test_lru_by_bytes():
    lru = EmbeddingLRU(max_bytes=3 * 400)  # room for three (10, 10) float32 tensors
    for k in "abc":
        lru.put(k, torch.zeros(10, 10))
    assert lru.get("a") is not None  # a is now the most recent
    lru.put("d", torch.zeros(10, 10))  # evicts b, the least recently used
    assert lru.get("b") is None and lru.get("c") is not None and lru.get("d") is not None
    lru.put("huge", torch.zeros(100, 100))  # larger than the whole cache: not stored, nothing evicted
    assert lru.get("huge") is None and lru.stats() | {} == {
        "hits": 3,
        "misses": 2,
        "evictions": 1,
        "entries": 3,
        "bytes": 1200,
        "max_bytes": 1200,
    }
