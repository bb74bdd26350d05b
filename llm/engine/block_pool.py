"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, and prefix reuse by content hash.

A full block whose KV has been computed is registered under a hash of (the hash of the block before it, its
token ids, and the content hashes of the images whose placeholders it holds; the first block's parent is the
tenant's scope), so a later sequence with the same
prefix (same text, same images) maps the same blocks instead of recomputing them. Blocks nobody references stay
cached until they are needed: the least recently freed go first. (The paged layout and hash-chained prefix
blocks follow vLLM's design; the code is ours.)
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


def chain_root(scope: str) -> bytes:
    """The parent of a sequence's first block: empty for the shared cache, else a hash of the tenant's scope, so that
    the chains of two scopes have no block in common (the text alone would match)."""
    return hashlib.blake2b(b"scope\0" + scope.encode(), digest_size=16).digest() if scope else b""


def block_hash(parent: bytes, token_ids: Sequence[int], image_keys: Sequence[str]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    for key in image_keys:  # placeholder ids are all alike: the images' own content tells blocks apart
        h.update(key.encode())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        self.num_blocks, self.block_size, self.enable_caching = num_blocks, block_size, enable_caching
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # oldest first
        self.hits = self.queries = 0  # prefix-cache blocks found / looked up

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def match_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks for the longest prefix of `hashes` (not yet taken: pass them to `take`)."""
        found: list[int] = []
        if self.enable_caching:
            for h in hashes:
                block = self._cached.get(h)
                if block is None:
                    break
                found.append(block)
        return found

    def record_lookup(self, queries: int, hits: int) -> None:
        self.queries += queries
        self.hits += hits

    def num_reusable(self, blocks: Sequence[int]) -> int:
        """How many of these cached blocks are now free (taking them uses up free blocks too)."""
        return sum(1 for b in blocks if self._ref[b] == 0)

    def take(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} KV blocks wanted, {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)  # least recently freed first
            if (h := self._hash[b]) is not None:  # evict its cached content
                del self._cached[h]
                self._hash[b] = None
            self._ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        # Last block first: a sequence's tail is evicted before its (more shareable) head.
        for b in reversed(blocks):
            self._ref[b] -= 1
            assert self._ref[b] >= 0, b
            if self._ref[b] == 0:
                self._free[b] = None

    def register(self, block: int, h: bytes) -> None:
        """The block is full and its KV computed: it may now serve other sequences with the same prefix."""
        if self.enable_caching and self._hash[block] is None and h not in self._cached:
            self._cached[h] = block
            self._hash[block] = h


__all__ = ["BlockPool", "block_hash", "chain_root"]
