"""The Encoder replica's class without Serve: the shared cache is an optimisation, never a point of failure; and
the out-of-band form embeddings travel in."""

from __future__ import annotations

import asyncio
import pickle

import pytest
import torch

from encoders import EmbeddingLRU
from encoders.server import Encoder
from schemas.transfer import _from_numpy, _to_numpy
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_out_of_band_tensor_round_trip(dtype):
    """What schemas/transfer.py sends for an embedding comes back equal, dtype and shape included."""
    embeds = torch.randn(37, 24).to(dtype)[:, 4:20]  # not contiguous
    payload = _to_numpy(embeds)
    back = _from_numpy(pickle.loads(pickle.dumps(payload, protocol=5)))
    assert back.dtype == dtype and back.shape == embeds.shape and back.equal(embeds)
