"""The embedding cache: bounded by bytes, least recently used out first, keyed by more than the bytes."""

from __future__ import annotations

import torch

from encoders import EmbeddingLRU, embedding_key


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


def test_key_has_size_and_mode_not_only_bytes():
    sha = "0" * 64  # the same bytes
    keys = {
        embedding_key(sha, 30, 100, "RGB", "p", "m"),
        embedding_key(sha, 100, 30, "RGB", "p", "m"),
        embedding_key(sha, 30, 100, "L", "p", "m"),
        embedding_key(sha, 30, 100, "RGB", "p2", "m"),
        embedding_key(sha, 30, 100, "RGB", "p", "m2"),
    }
    assert len(keys) == 5
