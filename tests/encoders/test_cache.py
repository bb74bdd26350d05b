"""The embedding cache: bounded by bytes, least recently used out first, keyed by more than the bytes."""

from __future__ import annotations

import torch

from encoders import EmbeddingLRU, cache_scope, embedding_key


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


def test_two_scopes_never_share_an_entry_and_one_keeps_its_hits():
    """Same image, two tenants (or two cache_salts): a miss; the same one again: a hit. No scope: the shared key."""
    scopes = [cache_scope(None, None), cache_scope("tenant-a", None), cache_scope("tenant-b", None)]
    scopes += [cache_scope(None, "salt"), cache_scope("tenant-a", "salt"), cache_scope("tenant-a", "other")]
    assert scopes[0] == "" and len(set(scopes)) == len(scopes)
    assert cache_scope("tenant-a", "salt") == cache_scope("tenant-a", "salt")
    sha = "0" * 64
    lru = EmbeddingLRU(max_bytes=1 << 20)
    lru.put(embedding_key(sha, 30, 100, "RGB", "p", "m", scopes[1]), torch.ones(2, 2))
    assert lru.get(embedding_key(sha, 30, 100, "RGB", "p", "m", scopes[2])) is None  # another tenant: a miss
    assert lru.get(embedding_key(sha, 30, 100, "RGB", "p", "m")) is None  # nor the shared cache
    assert lru.get(embedding_key(sha, 30, 100, "RGB", "p", "m", scopes[1])) is not None  # the same tenant: a hit
    assert embedding_key(sha, 30, 100, "RGB", "p", "m", "") == embedding_key(sha, 30, 100, "RGB", "p", "m")
