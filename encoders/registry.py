"""Model families, keyed by the checkpoint's `model_type`: how images become tokens, and the encoder that makes them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from PIL import Image

from encoders.qwen2_vl import Qwen2VLImageProcessing, Qwen2VLVisionEncoder


class ImageProcessing(Protocol):
    """The token count of an image from its size alone (the ingress needs it before any pixel work)."""

    merge_size: int

    def fingerprint(self) -> str: ...
    def resized_size(self, width: int, height: int) -> tuple[int, int]: ...
    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]: ...
    def num_image_tokens(self, width: int, height: int) -> int: ...


class VisionEncoder(Protocol):
    """ViT + projector: one (num_image_tokens, llm_hidden) tensor per image (as vLLM's SupportsMultiModal).

    `preprocess` is per image (CPU work, any thread); `forward` takes a batch of preprocessed images at once."""

    hidden_size: int

    def preprocess(self, image: Image.Image, size: tuple[int, int] | None = None) -> tuple[torch.Tensor, tuple[int, int, int]]: ...
    def forward(self, batch: list[tuple[torch.Tensor, tuple[int, int, int]]]) -> list[torch.Tensor]: ...
    def encode(self, images: list[Image.Image]) -> list[torch.Tensor]: ...


@dataclass(frozen=True, slots=True)
class Family:
    processing: type[Qwen2VLImageProcessing]
    encoder: type[Qwen2VLVisionEncoder]


FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family(processing=Qwen2VLImageProcessing, encoder=Qwen2VLVisionEncoder),
}


def family_of(model_dir: str | Path) -> Family:
    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"checkpoint model_type {model_type!r} is not supported; supported: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


__all__ = ["FAMILIES", "Family", "ImageProcessing", "VisionEncoder", "family_of"]
