"""Qwen2.5-VL images: Qwen2-VL's preprocessing and token counts, and its own ViT (window attention, RMSNorm, SwiGLU)
and merger.

NOTE: the preprocessing is Qwen2-VL's, so `Qwen2VLImageProcessing` serves both: transformers maps `qwen2_5_vl` to
`Qwen2VLImageProcessor`, and the hub's Qwen2.5-VL preprocessor_config.json files name that class (patch 14, merge 2,
temporal patch 2, smart_resize, CLIP mean/std); tests/encoders/test_qwen2_5_vl.py checks it against transformers.
The image token ids (`image_token_id`, `vision_start/end_token_id`, `video_token_id`) are Qwen2-VL's too.
"""

from __future__ import annotations

from typing import Any

from encoders.cost import VisionCost
from encoders.qwen2_vl import Qwen2VLVisionEncoder, qwen_flops_per_patch
from encoders.qwen_vit import Qwen2_5_VLViT


def qwen2_5_vl_cost(config: Any) -> VisionCost:
    """Qwen2.5-VL's ViT: full attention only in `fullatt_block_indexes`, the other layers within windows of
    window_size px (8x8 patches as shipped), so its attention grows nearly linearly with the image; a SwiGLU MLP."""
    vc = config.vision_config
    d, inter, full = int(vc.hidden_size), int(vc.intermediate_size), len(vc.fullatt_block_indexes)
    mlp = [(d, inter), (d, inter), (inter, d)]
    return VisionCost(
        qwen_flops_per_patch(vc, d, mlp, int(vc.out_hidden_size)),
        d,
        full_layers=full,
        window_layers=int(vc.depth) - full,
        window=(vc.window_size // vc.patch_size) ** 2,
    )


class Qwen2_5_VLVisionEncoder(Qwen2VLVisionEncoder):
    """Qwen2.5-VL's ViT and patch merger, loaded alone from the checkpoint's `visual.*` weights.

    `preprocess`, `forward` and `encode` are Qwen2-VL's: one packed forward for a batch, split per image. The ViT
    reorders each image's merged tokens into windows and restores the order after the merger, so the split holds."""

    tower = Qwen2_5_VLViT  # ours (encoders/qwen_vit.py), as Qwen2-VL's

    # NOTE: Qwen2.5-VL's vision `hidden_size` is the ViT's own width; the merger's output (the LM's) is
    # `out_hidden_size` (Qwen2-VL named them embed_dim and hidden_size).
    out_width = "out_hidden_size"


__all__ = ["Qwen2_5_VLVisionEncoder", "qwen2_5_vl_cost"]
