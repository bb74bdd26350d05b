"""A byte-bounded LRU of image embeddings, keyed by everything that determines an embedding."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch


def embedding_key(
    content_sha256: str, width: int, height: int, mode: str, preprocessing: str, model: str, scope: str = ""
) -> str:
    """Not the bytes alone: size and mode are in the key (a 30x100 and a 100x30 image with the same pixel bytes
    differ), and so are the preprocessing settings and the model; and the tenant's cache scope, so that two tenants
    never share an entry (`cache_scope`; "" for the shared one)."""
    key = f"{content_sha256}:{width}x{height}:{mode}:{preprocessing}:{model}"
    return f"{key}:{scope}" if scope else key


def cache_scope(tenant: str | None, salt: str | None) -> str:
    """The scope of a request's cache entries, embeddings and prefix KV: its API key's tenant and its `cache_salt`
    (vLLM's field); "" (shared) when it has neither."""
    if tenant is None and salt is None:
        return ""
    return hashlib.blake2b(f"{tenant or ''}\0{salt or ''}".encode(), digest_size=16).hexdigest()


class EmbeddingLRU:
    def __init__(self, max_bytes: int):
        self.max_bytes, self.nbytes = max_bytes, 0
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = self.misses = self.evictions = 0

    def get(self, key: str) -> torch.Tensor | None:
        value = self._items.get(key)
        if value is None:
            self.misses += 1
            return None
        self._items.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: str, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.max_bytes or key in self._items:
            return
        while self.nbytes + size > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.nbytes -= old.numel() * old.element_size()
            self.evictions += 1
        self._items[key] = value
        self.nbytes += size

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "entries": len(self._items),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
        }


__all__ = ["EmbeddingLRU", "cache_scope", "embedding_key"]
