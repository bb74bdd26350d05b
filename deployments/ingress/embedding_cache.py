"""The embedding cache of the encoder tier: by content key, the ObjectRefs of embeddings the Encoder replicas made,
held by the ingress replica that asked for them (and owns them). The embeddings stay where Ray put them (the object
store of the node that encoded them, or under Ray's inline limit in this process's store); a hit costs a dict
lookup here and no call anywhere: the ref goes to the LLM as a fresh one would. It sits where the key is known,
so no image's path crosses a shared process (the shared EmbeddingCache replica it replaces was one hop and one copy
per image, and capped the whole tier).

An entry is one job's place in what one encoder call returned (a call returns a list: the request's images, as many
as one ViT forward takes). The call's object lives while any of its entries is here, and counts whole against the
budget. Bytes are counted at 4 a value (float32): the ingress does not know the encoders' dtype, so a bfloat16 tier
holds at most the budget and perhaps half of what it could. Each ingress replica has its own: a conversation whose
turns reach another ingress replica misses once there."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

Ref = Any  # a ray.ObjectRef (anything hashable in tests)


@dataclass(slots=True)
class _Object:
    nbytes: int
    entries: int = 0


class EmbeddingRefs:
    """LRU by bytes of (ref, position) by key. Not thread-safe: the ingress's event loop is its one user."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.nbytes = max_bytes, 0
        self._entries: OrderedDict[str, tuple[Ref, int]] = OrderedDict()
        self._objects: dict[Ref, _Object] = {}
        self.hits = self.misses = self.evictions = 0

    def get(self, key: str) -> tuple[Ref, int] | None:
        """(the call's ref, the job's position in what it returned), or None."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, keys: list[str], ref: Ref, nbytes: int) -> None:
        """What one call returned: `keys[i]` is the job at position i; `nbytes`, the whole object's. A call bigger
        than the budget is not kept; a key already here keeps its entry."""
        if nbytes > self.max_bytes or ref in self._objects:
            return
        new = [(i, key) for i, key in enumerate(keys) if key not in self._entries]
        if not new:
            return
        obj = self._objects[ref] = _Object(nbytes)
        self.nbytes += nbytes
        for i, key in new:
            self._entries[key] = (ref, i)
            obj.entries += 1
        while self.nbytes > self.max_bytes:
            key, _ = next(iter(self._entries.items()))
            self._remove(key)
            self.evictions += 1

    def discard(self, refs: Iterable[Ref]) -> None:
        """Forget every entry in these calls' results (they failed, were cancelled, or their replica is gone)."""
        gone = {ref for ref in refs if ref in self._objects}
        if gone:
            for key in [k for k, (ref, _) in self._entries.items() if ref in gone]:
                self._remove(key)

    def _remove(self, key: str) -> None:
        ref, _ = self._entries.pop(key)
        obj = self._objects[ref]
        obj.entries -= 1
        if obj.entries == 0:  # the last entry of the call: its object goes (when the LLM holds it no more)
            del self._objects[ref]
            self.nbytes -= obj.nbytes

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "entries": len(self._entries),
            "objects": len(self._objects),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
        }


__all__ = ["EmbeddingRefs"]
