"""Images from concurrent callers packed into one encoder forward, bounded by a patch budget and a maximum wait."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

Preprocessed = tuple[torch.Tensor, tuple[int, int, int]]  # (pixel_values (patches, dim), grid (t, h, w))


@dataclass(slots=True)
class _Item:
    image: Preprocessed
    future: asyncio.Future

    @property
    def patches(self) -> int:
        return self.image[0].shape[0]


class ImageBatcher:
    """`await encode(image)` from many tasks; a batch closes when it reaches `max_patches` or, while the
    encoder is idle, after `max_wait_s`. The forward runs on a worker thread, off the event loop. An image larger
    than the budget runs alone. (Like Ray Serve's `@serve.batch`, but bounded by patches, not by count.)"""

    def __init__(
        self,
        forward: Callable[[list[Preprocessed]], list[torch.Tensor]],
        *,
        max_patches: int,
        max_wait_s: float,
        on_batch: Callable[[int, float], None] | None = None,
    ):
        self.forward, self.max_patches, self.max_wait_s = forward, max_patches, max_wait_s
        self.on_batch = on_batch  # (images, seconds) of each forward that ran, for metrics
        self._queue: asyncio.Queue[_Item] | None = None
        self._task: asyncio.Task | None = None
        self.num_batches = self.num_images = 0

    async def encode(self, image: Preprocessed) -> torch.Tensor:
        if self._task is None:  # created on the loop that uses it
            self._queue = asyncio.Queue()
            self._task = asyncio.create_task(self._loop())
        assert self._queue is not None
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Item(image, future))
        return await future

    async def _collect(self, first: _Item) -> tuple[list[_Item], _Item | None]:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        batch, patches, deadline = [first], first.patches, loop.time() + self.max_wait_s
        while patches < self.max_patches:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                try:
                    async with asyncio.timeout_at(deadline):  # NOTE: not wait_for: see tests/test_house.py
                        item = await self._queue.get()
                except TimeoutError:
                    break
            if patches + item.patches > self.max_patches:
                return batch, item  # it opens the next batch
            batch.append(item)
            patches += item.patches
        return batch, None

    async def _loop(self) -> None:
        assert self._queue is not None
        carry: _Item | None = None
        while True:
            batch, carry = await self._collect(carry or await self._queue.get())
            live = [item for item in batch if not item.future.done()]  # callers that gave up are skipped
            if not live:
                continue
            started = time.monotonic()
            try:
                outputs = await asyncio.to_thread(self.forward, [item.image for item in live])
            except Exception as e:  # every caller of this batch gets the error; the loop goes on
                for item in live:
                    if not item.future.done():
                        item.future.set_exception(e)
                continue
            self.num_batches += 1
            self.num_images += len(live)
            if self.on_batch is not None:
                self.on_batch(len(live), time.monotonic() - started)
            for item, out in zip(live, outputs, strict=True):
                if not item.future.done():
                    item.future.set_result(out)


__all__ = ["ImageBatcher", "Preprocessed"]
