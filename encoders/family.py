"""What a model family is: the image processing and vision encoder contracts (`Protocol`s), its image token ids,
its tower's cost, and the `Family` record the registry holds. The family modules and the registry import this; it
imports neither."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from PIL import Image

from encoders.cost import VisionCost


class ImageProcessing(Protocol):
    """The token count of an image from its size alone (the ingress needs it before any pixel work)."""

    merge_size: int  # grid cells (per side) merged into one token; grid_thw's t*h*w // merge_size**2 tokens

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, config: Any = None) -> ImageProcessing: ...
    @property
    def max_image_tokens(self) -> int: ...  # the largest count any image can take (admission, memory sizing)
    def worst_case_size(self) -> tuple[int, int]: ...  # (width, height) of an image with the most tokens
    def fingerprint(self) -> str: ...
    def resized_size(self, width: int, height: int) -> tuple[int, int]: ...
    def grid_thw(self, width: int, height: int) -> tuple[int, int, int]: ...
    def num_image_tokens(self, width: int, height: int) -> int: ...


class VisionEncoder(Protocol):
    """ViT + projector: one (num_image_tokens, llm_hidden) tensor per image (as vLLM's SupportsMultiModal).

    `preprocess` is per image (CPU work, any thread); `forward` takes a batch of preprocessed images at once."""

    hidden_size: int

    def preprocess(
        self, image: Image.Image, size: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, tuple[int, int, int]]: ...
    def forward(self, batch: list[tuple[torch.Tensor, tuple[int, int, int]]]) -> list[torch.Tensor]: ...
    def encode(self, images: list[Image.Image]) -> list[torch.Tensor]: ...


@dataclass(frozen=True, slots=True)
class ImageTokens:
    """A checkpoint's image token ids: the placeholder each image's run is made of, the markers its chat template
    writes once per image (and video) around the run, placeholders of inputs this server does not take, and the
    placeholder of a video's run where the family takes video."""

    placeholder_id: int
    per_image_ids: tuple[int, ...] = ()
    forbidden_ids: tuple[int, ...] = ()
    video_placeholder_id: int | None = None


@dataclass(frozen=True, slots=True)
class Family:
    """What a model family adds: preprocessing and token counts, the encoder, and its image token ids. (The LM's
    position rule comes from its config: M-RoPE when it has an `mrope_section`, else 1-D.)"""

    processing: Callable[..., Any]  # a class with ImageProcessing's methods and from_pretrained(model_dir, config)
    encoder: Callable[..., VisionEncoder]  # (model_dir, device=, dtype=, config=) -> VisionEncoder
    image_tokens: Callable[[Any], ImageTokens]  # from the checkpoint's transformers config
    cost: Callable[[Any], VisionCost]  # the tower's shape, from the same config: a grid's cost (encoders/cost.py)
    max_images_per_prompt: int | None = None  # the family's own limit, if it has one
    projector: str | None = None  # attribute path of the projector in the encoder object, to place it on its own
    video_processing: Callable[..., Any] | None = None  # from_pretrained(model_dir) -> video sampling; None: no video
    # DeepStack levels an image's embedding carries after its D columns (Qwen3-VL: encoders/qwen3_vl.py); None: none
    deepstack_levels: Callable[[Any], int] | None = None


__all__ = ["Family", "ImageProcessing", "ImageTokens", "VisionEncoder"]
