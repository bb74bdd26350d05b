"""A byte-bounded LRU of image embeddings by their keys (made by the ingress: deployments/ingress/prepare.py
`embedding_key`): the colocated encoder's, in the LLM replica. The encoder tier's cache is the ingress's references
(deployments/ingress/generate.py `EmbeddingRefs`)."""

from __future__ import annotations

from collections import OrderedDict

import torch


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


__all__ = ["EmbeddingLRU"]
