"""The model families this server takes, in a plain dict keyed by the checkpoint's `model_type`."""

from __future__ import annotations

import json
from pathlib import Path

from encoders.checkpoint_config import read_config
from encoders.family import Family, ImageTokens
from encoders.llava import LlavaVisionEncoder, llava_cost, llava_image_tokens
from encoders.llava_next import LlavaNextImageProcessing, LlavaNextVisionEncoder
from encoders.llava_processing import LlavaImageProcessing
from encoders.qwen2_5_vl import Qwen2_5_VLVisionEncoder, qwen2_5_vl_cost
from encoders.qwen2_vl import Qwen2VLImageProcessing, Qwen2VLVisionEncoder, qwen2_vl_cost, qwen2_vl_image_tokens
from encoders.video_processing import Qwen2VLVideoProcessing

FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family(
        processing=Qwen2VLImageProcessing,
        encoder=Qwen2VLVisionEncoder,
        cost=qwen2_vl_cost,
        image_tokens=qwen2_vl_image_tokens,
        projector="vit.merger",
        video_processing=Qwen2VLVideoProcessing,
    ),
    # Qwen2.5-VL: Qwen2-VL's preprocessing and image tokens, its own ViT (see encoders/qwen2_5_vl.py).
    "qwen2_5_vl": Family(
        processing=Qwen2VLImageProcessing,
        encoder=Qwen2_5_VLVisionEncoder,
        cost=qwen2_5_vl_cost,
        image_tokens=qwen2_vl_image_tokens,
        projector="vit.merger",
        video_processing=Qwen2VLVideoProcessing,
    ),
    "llava": Family(
        processing=LlavaImageProcessing,
        encoder=LlavaVisionEncoder,
        cost=llava_cost,
        image_tokens=llava_image_tokens,
        projector="projector",
    ),
    "llava_next": Family(
        processing=LlavaNextImageProcessing,
        encoder=LlavaNextVisionEncoder,
        cost=llava_cost,
        image_tokens=llava_image_tokens,
        projector="projector",
    ),
}


def family_of(model_dir: str | Path, name: str | None = None) -> Family:
    """The family named in `args.family`, else the one of the checkpoint's `model_type`."""
    return family_for(json.loads((Path(model_dir) / "config.json").read_text()).get("model_type"), name)


def family_for(model_type: str | None, name: str | None = None) -> Family:
    """The family named in `args.family`, else the one of this `model_type`."""
    if name is not None:
        if name not in FAMILIES:
            raise ValueError(f"family {name!r} is not supported; supported: {sorted(FAMILIES)}")
        return FAMILIES[name]
    if model_type not in FAMILIES:
        raise ValueError(
            f"checkpoint model_type {model_type!r} is not supported; supported: {sorted(FAMILIES)} "
            "(name one with args.family if the checkpoint is one of them under another model_type)"
        )
    return FAMILIES[model_type]


def image_tokens_of(model_dir: str | Path, name: str | None = None) -> ImageTokens:
    return family_of(model_dir, name).image_tokens(read_config(model_dir))


__all__ = ["FAMILIES", "family_for", "family_of", "image_tokens_of"]
