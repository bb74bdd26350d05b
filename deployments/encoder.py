"""Encoder deployment: image bytes in, one (num_image_tokens, llm_hidden) embedding tensor out, via the object store."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import torch
from ray import serve

from encoders import VisionEncoder, family_of, load_rgb
from schemas import AppArgs, resolve_device, resolve_dtype

logger = logging.getLogger("ray.serve")


@serve.deployment(
    name="Encoder",
    ray_actor_options={"num_cpus": 0.4},
    max_ongoing_requests=8,
    autoscaling_config={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2},
)
class Encoder:
    def __init__(self, args: dict[str, Any], model_factory: Callable[..., VisionEncoder] | None = None):
        self.args = AppArgs.model_validate(args)
        device = resolve_device(self.args.device, torch.cuda.is_available())
        dtype = getattr(torch, resolve_dtype(self.args.dtype, device))
        factory = model_factory or family_of(self.args.model).encoder
        self.encoder = factory(self.args.model, device=device, dtype=dtype)
        logger.info("encoder ready: %s on %s (%s)", self.args.model, device, dtype)

    def _encode(self, image: bytes) -> torch.Tensor:
        return self.encoder.encode([load_rgb(image)])[0].cpu()

    async def encode(self, image: bytes) -> torch.Tensor:
        # NOTE: returned, not ray.put: the caller owns the result, so it outlives this replica.
        return await asyncio.to_thread(self._encode, image)
