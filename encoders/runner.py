"""Image bytes in, embeddings out: decode and preprocess on a worker thread, then a batched ViT forward.

Used by the Encoder deployment, and by the LLM replica itself in colocated mode (`encoder.colocated`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import torch

from encoders.batching import ImageBatcher, Preprocessed
from encoders.images import image_size, load_rgb
from encoders.registry import VisionEncoder, family_of
from schemas import EncoderArgs


class EncoderRunner:
    def __init__(self, model_dir: str | Path, opts: EncoderArgs, *, device: str, dtype: torch.dtype,
                 model_factory: Callable[..., VisionEncoder] | None = None,
                 on_batch: Callable[[int, float], None] | None = None):
        family = family_of(model_dir)
        self.processing = family.processing.from_pretrained(model_dir)
        self.encoder = (model_factory or family.encoder)(model_dir, device=device, dtype=dtype)
        self.jpeg_draft = opts.jpeg_draft
        self.batcher = ImageBatcher(self.encoder.forward, max_patches=opts.max_batch_patches,
                                    max_wait_s=opts.max_batch_wait_ms / 1000, on_batch=on_batch)

    def _preprocess(self, data: bytes) -> Preprocessed:
        if self.jpeg_draft:  # decode at a reduced scale where the target size allows (JPEG only)
            size = image_size(data)
            return self.encoder.preprocess(load_rgb(data, draft_size=self.processing.resized_size(*size)), size)
        return self.encoder.preprocess(load_rgb(data))

    async def encode(self, data: bytes) -> torch.Tensor:
        preprocessed = await asyncio.to_thread(self._preprocess, data)  # off the event loop
        return (await self.batcher.encode(preprocessed)).cpu()

    def stats(self) -> dict[str, int]:
        return {"batches": self.batcher.num_batches, "images": self.batcher.num_images}


__all__ = ["EncoderRunner"]
