"""Model families, keyed by the checkpoint's `model_type`: how images become tokens, and the encoder that makes them."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from PIL import Image
from transformers import AutoConfig

from encoders.llava import LlavaVisionEncoder, llava_image_tokens
from encoders.llava_processing import LlavaImageProcessing
from encoders.llava_next import LlavaNextImageProcessing, LlavaNextVisionEncoder
from encoders.qwen2_5_vl import Qwen2_5_VLVisionEncoder
from encoders.qwen2_vl import Qwen2VLImageProcessing, Qwen2VLVisionEncoder, qwen2_vl_image_tokens


class ImageProcessing(Protocol):
    """The token count of an image from its size alone (the ingress needs it before any pixel work)."""

    merge_size: int  # grid cells (per side) merged into one token; grid_thw's t*h*w // merge_size**2 tokens

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ImageProcessing: ...
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

    def preprocess(self, image: Image.Image, size: tuple[int, int] | None = None) -> tuple[torch.Tensor, tuple[int, int, int]]: ...
    def forward(self, batch: list[tuple[torch.Tensor, tuple[int, int, int]]]) -> list[torch.Tensor]: ...
    def encode(self, images: list[Image.Image]) -> list[torch.Tensor]: ...


@dataclass(frozen=True, slots=True)
class ImageTokens:
    """A checkpoint's image token ids: the placeholder each image's run is made of, the markers its chat template
    writes once per image around the run, and placeholders of inputs this server does not take (video)."""

    placeholder_id: int
    per_image_ids: tuple[int, ...] = ()
    forbidden_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Family:
    """What a model family adds: preprocessing and token counts, the encoder, and its image token ids. (The LM's
    position rule comes from its config: M-RoPE when it has an `mrope_section`, else 1-D.)"""

    processing: Callable[..., Any]  # a class with ImageProcessing's methods and from_pretrained(model_dir)
    encoder: Callable[..., VisionEncoder]  # (model_dir, device=, dtype=) -> VisionEncoder
    image_tokens: Callable[[Any], ImageTokens]  # from the checkpoint's transformers config
    max_images_per_prompt: int | None = None  # the family's own limit, if it has one
    projector: str | None = None  # attribute path of the projector in the encoder object, to place it on its own


FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family(processing=Qwen2VLImageProcessing, encoder=Qwen2VLVisionEncoder,
                       image_tokens=qwen2_vl_image_tokens, projector="vit.merger"),
    # Qwen2.5-VL: Qwen2-VL's preprocessing and image tokens, its own ViT (see encoders/qwen2_5_vl.py).
    "qwen2_5_vl": Family(processing=Qwen2VLImageProcessing, encoder=Qwen2_5_VLVisionEncoder,
                         image_tokens=qwen2_vl_image_tokens, projector="vit.merger"),
    "llava": Family(processing=LlavaImageProcessing, encoder=LlavaVisionEncoder, image_tokens=llava_image_tokens,
                    projector="projector"),
    "llava_next": Family(processing=LlavaNextImageProcessing, encoder=LlavaNextVisionEncoder,
                         image_tokens=llava_image_tokens, projector="projector"),
}


def family_of(model_dir: str | Path, name: str | None = None) -> Family:
    """The family named in `args.family`, else the one of the checkpoint's `model_type`."""
    if name is not None:
        if name not in FAMILIES:
            raise ValueError(f"family {name!r} is not supported; supported: {sorted(FAMILIES)}")
        return FAMILIES[name]
    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"checkpoint model_type {model_type!r} is not supported; supported: {sorted(FAMILIES)} "
                         "(name one with args.family if the checkpoint is one of them under another model_type)")
    return FAMILIES[model_type]


def image_tokens_of(model_dir: str | Path, name: str | None = None) -> ImageTokens:
    return family_of(model_dir, name).image_tokens(AutoConfig.from_pretrained(model_dir))


__all__ = ["FAMILIES", "Family", "ImageProcessing", "ImageTokens", "VisionEncoder", "family_of", "image_tokens_of"]
