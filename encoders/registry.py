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
from encoders.qwen3_vl import Qwen3VLVisionEncoder, deepstack_levels, qwen3_vl_cost
from encoders.video_processing import Qwen2VLVideoProcessing, Qwen3VLVideoProcessing

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
    # Qwen3-VL (dense LMs): Qwen2-VL's preprocessing (its patch 16 from preprocessor_config.json) and image tokens,
    # its own ViT whose embeddings carry the DeepStack levels (encoders/qwen3_vl.py); video with each tubelet's
    # timestamp in the prompt (encoders/video_processing.py).
    "qwen3_vl": Family(
        processing=Qwen2VLImageProcessing,
        encoder=Qwen3VLVisionEncoder,
        cost=qwen3_vl_cost,
        image_tokens=qwen2_vl_image_tokens,
        projector=None,
        video_processing=Qwen3VLVideoProcessing,
        deepstack_levels=deepstack_levels,
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


# Checkpoints of a supported family's make that need what the engine does not have, and what that is.
UNSUPPORTED = {
    "qwen3_vl_moe": "Qwen3-VL's MoE models (30B-A3B, 235B-A22B) need mixture-of-experts layers, which the engine does "
    "not have; its dense models (2B, 4B, 8B, 32B) are supported"
}


def family_for(model_type: str | None, name: str | None = None) -> Family:
    """The family named in `args.family`, else the one of this `model_type`."""
    if model_type in UNSUPPORTED and name is None:
        raise ValueError(f"checkpoint model_type {model_type!r} is not supported: {UNSUPPORTED[model_type]}")
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
