"""Packing images from concurrent callers into one encoder forward: same outputs, bounded batches."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from demo.inputs import make_image
from encoders import ImageBatcher, Qwen2VLVisionEncoder

SIZES = [(57, 31), (300, 140), (28, 28), (40, 260), (120, 80), (90, 90)]


def test_batched_equals_one_by_one(checkpoint):
    encoder = Qwen2VLVisionEncoder(checkpoint)
    pre = [encoder.preprocess(make_image(w, h, seed=i)) for i, (w, h) in enumerate(SIZES)]
    alone = [encoder.forward([p])[0] for p in pre]
    batcher = ImageBatcher(encoder.forward, max_patches=10_000, max_wait_s=0.05)

    async def together():
        return await asyncio.gather(*(batcher.encode(p) for p in pre))

    batched = asyncio.run(together())
    assert batcher.num_batches < len(SIZES)  # they really shared forwards
    for a, b in zip(alone, batched, strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)  # fp32 rounding of other GEMM shapes


def _fake(patches: list[int]):
    calls: list[list[int]] = []

    def forward(batch):
        calls.append([pv.shape[0] for pv, _ in batch])
        time.sleep(0.05)
        return [pv.sum(-1, keepdim=True) for pv, _ in batch]

    return [(torch.ones(n, 4), (1, n, 1)) for n in patches], calls, forward


def test_patch_budget_and_oversized_images():
    images, calls, forward = _fake([30, 30, 30, 100, 10])
    batcher = ImageBatcher(forward, max_patches=64, max_wait_s=0.2)

    async def run():
        return await asyncio.gather(*(batcher.encode(im) for im in images))

    outs = asyncio.run(run())
    assert [o.shape[0] for o in outs] == [30, 30, 30, 100, 10]
    assert all(sum(c) <= 64 or len(c) == 1 for c in calls)  # within budget, or one image alone
    assert [n for c in calls for n in c] == [30, 30, 30, 100, 10]  # first come, first served


def test_idle_encoder_waits_at_most_max_wait():
    images, calls, forward = _fake([5])
    batcher = ImageBatcher(forward, max_patches=1000, max_wait_s=0.1)
    started = time.perf_counter()
    asyncio.run(batcher.encode(images[0]))
    assert 0.1 <= time.perf_counter() - started < 1.0 and calls == [[5]]


def test_a_failing_forward_fails_its_batch_only():
    fail = {"on": True}

    def forward(batch):
        if fail["on"]:
            fail["on"] = False
            raise RuntimeError("boom")
        return [pv for pv, _ in batch]

    batcher = ImageBatcher(forward, max_patches=100, max_wait_s=0.05)

    async def run():
        first = await asyncio.gather(
            *(batcher.encode((torch.ones(2, 2), (1, 2, 1))) for _ in range(3)), return_exceptions=True
        )
        second = await batcher.encode((torch.ones(2, 2), (1, 2, 1)))
        return first, second

    first, second = asyncio.run(run())
    assert all(isinstance(e, RuntimeError) for e in first) and second.shape == (2, 2)


@pytest.mark.parametrize("fmt", ["JPEG"])
def test_jpeg_draft_keeps_the_grid_and_stays_close(checkpoint, fmt):
    from demo.inputs import image_bytes
    from encoders import image_size, load_rgb

    encoder = Qwen2VLVisionEncoder(checkpoint)
    data = image_bytes(make_image(1600, 1200, seed=9), fmt)
    size = image_size(data)
    full, grid_full = encoder.preprocess(load_rgb(data))
    draft, grid_draft = encoder.preprocess(load_rgb(data, draft_size=encoder.processing.resized_size(*size)), size)
    assert grid_draft == grid_full  # the token count the ingress promised still holds
    assert (draft - full).abs().mean() < 0.1  # close, not equal: why it is opt-in
