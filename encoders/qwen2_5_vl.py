"""Qwen2.5-VL images: Qwen2-VL's preprocessing and token counts, and its own ViT (window attention, RMSNorm, SwiGLU)
and merger.

NOTE: the preprocessing is Qwen2-VL's, so `Qwen2VLImageProcessing` serves both: transformers maps `qwen2_5_vl` to
`Qwen2VLImageProcessor`, and the hub's Qwen2.5-VL preprocessor_config.json files name that class (patch 14, merge 2,
temporal patch 2, smart_resize, CLIP mean/std); tests/encoders/test_qwen2_5_vl.py checks it against transformers.
The image token ids (`image_token_id`, `vision_start/end_token_id`, `video_token_id`) are Qwen2-VL's too.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
    Qwen2_5_VLVisionRotaryEmbedding,
)

from encoders.qwen2_vl import Qwen2VLImageProcessing, Qwen2VLVisionEncoder
from schemas import load_components


class Qwen2_5_VLVisionEncoder(Qwen2VLVisionEncoder):
    """Qwen2.5-VL's ViT and patch merger, loaded alone from the checkpoint's `visual.*` weights.

    `preprocess`, `forward` and `encode` are Qwen2-VL's: one packed forward for a batch, split per image. The ViT
    reorders each image's merged tokens into windows and restores the order after the merger, so the split holds."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
        config = AutoConfig.from_pretrained(model_dir).vision_config
        self.processing = Qwen2VLImageProcessing.from_pretrained(model_dir)
        self.device, self.dtype = torch.device(device), dtype
        weights = load_components(model_dir, {"vision"})["vision"]
        with torch.device("meta"):  # no random init of weights we are about to replace
            vit = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, attn_implementation="sdpa")
        vit.load_state_dict(weights, strict=True, assign=True)
        vit.rotary_pos_emb = Qwen2_5_VLVisionRotaryEmbedding(config)  # non-persistent buffers: build them for real
        self.vit = vit.to(device=self.device, dtype=dtype).eval()
        # NOTE: Qwen2.5-VL's vision `hidden_size` is the ViT's own width; the merger's output (the LM's) is
        # `out_hidden_size` (Qwen2-VL named them embed_dim and hidden_size).
        self.hidden_size = int(config.out_hidden_size)


__all__ = ["Qwen2_5_VLVisionEncoder"]
