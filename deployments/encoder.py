"""Encoder deployment: image bytes in, one (num_image_tokens, llm_hidden) embedding tensor out, via the object store."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import torch
from ray import serve
from ray.serve.handle import DeploymentHandle

from encoders import ImageBatcher, VisionEncoder, family_of, image_size, load_rgb
from schemas import AppArgs, resolve_device, resolve_dtype

logger = logging.getLogger("ray.serve")


@serve.deployment(
    name="Encoder",
    ray_actor_options={"num_cpus": 0.4},
    max_ongoing_requests=16,
    autoscaling_config={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 4},
)
class Encoder:
    def __init__(self, args: dict[str, Any], cache: DeploymentHandle | None = None,
                 model_factory: Callable[..., VisionEncoder] | None = None):
        self.args = AppArgs.model_validate(args)
        device = resolve_device(self.args.device, torch.cuda.is_available())
        dtype = getattr(torch, resolve_dtype(self.args.dtype, device))
        family = family_of(self.args.model)
        self.processing = family.processing.from_pretrained(self.args.model)
        self.encoder = (model_factory or family.encoder)(self.args.model, device=device, dtype=dtype)
        opts = self.args.encoder
        self.batcher = ImageBatcher(self.encoder.forward, max_patches=opts.max_batch_patches,
                                    max_wait_s=opts.max_batch_wait_ms / 1000)
        self.cache, self._puts = cache, set()
        logger.info("encoder ready: %s on %s (%s), cache %s", self.args.model, device, dtype,
                    "on" if cache is not None else "off")

    def _preprocess(self, data: bytes):
        if self.args.encoder.jpeg_draft:
            size = image_size(data)
            return self.encoder.preprocess(load_rgb(data, draft_size=self.processing.resized_size(*size)), size)
        return self.encoder.preprocess(load_rgb(data))

    async def _cached(self, key: str) -> torch.Tensor | None:
        try:
            return await self.cache.get.remote(key)
        except Exception:  # a cache that is down or restarting is a miss, never a failure
            logger.warning("embedding cache unavailable; encoding %s", key[:16], exc_info=True)
            return None

    async def _put(self, key: str, embeds: torch.Tensor) -> None:
        try:
            await self.cache.put.remote(key, embeds)
        except Exception:
            logger.warning("could not cache %s", key[:16], exc_info=True)

    async def encode(self, image: bytes, key: str | None = None) -> torch.Tensor:
        # NOTE: returned, not ray.put: the caller owns the result, so it outlives this replica.
        if key is not None and self.cache is not None and (hit := await self._cached(key)) is not None:
            return hit
        preprocessed = await asyncio.to_thread(self._preprocess, image)  # decode + resize, off the event loop
        embeds = (await self.batcher.encode(preprocessed)).cpu()
        if key is not None and self.cache is not None:
            task = asyncio.create_task(self._put(key, embeds))
            self._puts.add(task)
            task.add_done_callback(self._puts.discard)
        return embeds

    async def stats(self) -> dict[str, int]:
        return {"batches": self.batcher.num_batches, "images": self.batcher.num_images}
