"""The Encoder replica's class without Serve: the shared cache is an optimisation, never a point of failure."""

from __future__ import annotations

import asyncio

import torch

from deployments import Encoder
from encoders import EmbeddingLRU
from tests.helpers import image_bytes, make_image


class _Call:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def run():
            return self.fn(*args)
        return run()


class FakeCache:
    """What the replica uses of a DeploymentHandle to EmbeddingCache; `down` makes every call fail."""

    def __init__(self, down: bool = False):
        self.lru, self.down = EmbeddingLRU(1 << 20), down
        self.get, self.put = _Call(self._get), _Call(self._put)

    def _get(self, key):
        if self.down:
            raise ConnectionError("cache replica is gone")
        return self.lru.get(key)

    def _put(self, key, value):
        if self.down:
            raise ConnectionError("cache replica is gone")
        self.lru.put(key, value)


def _encode_twice(checkpoint, cache) -> list[torch.Tensor]:
    encoder = Encoder.func_or_class({"model": str(checkpoint)}, cache)
    data = image_bytes(make_image(70, 50, seed=3))

    async def run():
        first = await encoder.encode(data, "k")
        await asyncio.gather(*encoder._puts)  # the background put
        return [first, await encoder.encode(data, "k"), await encoder.encode(data)]

    return asyncio.run(run())


def test_hit_returns_the_cached_embedding(checkpoint):
    cache = FakeCache()
    first, again, uncached = _encode_twice(checkpoint, cache)
    assert (cache.lru.hits, cache.lru.misses) == (1, 1)
    assert again is cache.lru.get("k") and again.equal(first) and uncached.equal(first)


def test_cache_down_means_encode(checkpoint):
    first, again, uncached = _encode_twice(checkpoint, FakeCache(down=True))
    assert first.equal(again) and first.equal(uncached)


def test_cache_off_is_never_called(checkpoint):
    cache = FakeCache(down=True)
    encoder = Encoder.func_or_class({"model": str(checkpoint), "encoder": {"cache_gib": 0}}, cache)
    assert encoder.cache is None
