"""Qwen3-VL images: Qwen2-VL's preprocessing and token counts (patch 16 and merge 2 read from
preprocessor_config.json: a resize factor of 32), its own ViT (encoders/qwen3_vl_vit.py), and DeepStack.

An image's embedding here is one tensor, (tokens, (1 + L) * D): the merged embeddings, then the L DeepStack levels
(the features taken after the ViT blocks of `deepstack_visual_indexes`), side by side. So it travels as the other
families' do, one tensor per image with a row per placeholder token (the object store, the embedding cache, a video's
chunks concatenated by rows), and the LLM takes the first D columns into the prompt's embeddings and adds level l's
after its decoder layer l (llm/engine/model_runner.py, llm/model/model.py). The transfer is (1 + L) times Qwen2-VL's.

NOTE: transformers maps `qwen3_vl` to Qwen2VLImageProcessor, so `Qwen2VLImageProcessing` serves it from the
checkpoint's preprocessor_config.json (patch 16, mean and std 0.5); the image token ids are Qwen2-VL's fields.
"""

from __future__ import annotations

from typing import Any

import torch

from encoders.cost import VisionCost, linear_flops
from encoders.qwen2_vl import Qwen2VLVisionEncoder
from encoders.qwen3_vl_vit import Qwen3VLViT


def deepstack_levels(config: Any) -> int:
    """How many DeepStack levels an image's embedding carries beside its merged embeddings."""
    return len(config.vision_config.deepstack_visual_indexes)


def qwen3_vl_cost(config: Any) -> VisionCost:
    """Qwen3-VL's ViT: full attention in every block over an image's patches (a video's frame's), a GELU MLP of
    intermediate_size, the merger and one more merger per DeepStack level (one row per merge_size**2 patches)."""
    vc = config.vision_config
    d, inter, out = int(vc.hidden_size), int(vc.intermediate_size), int(vc.out_hidden_size)
    m2 = vc.spatial_merge_size**2
    embed = linear_flops((vc.in_channels * vc.temporal_patch_size * vc.patch_size**2, d))
    blocks = vc.depth * linear_flops((d, 3 * d), (d, d), (d, inter), (inter, d))
    mergers = (1 + deepstack_levels(config)) * linear_flops((d * m2, d * m2), (d * m2, out)) / m2
    return VisionCost(embed + blocks + mergers, d, int(vc.depth))


class Qwen3VLVisionEncoder(Qwen2VLVisionEncoder):
    """Qwen3-VL's ViT, merger and DeepStack mergers, loaded alone from the checkpoint's vision weights. `forward`
    returns one (tokens, (1 + L) * D) tensor per image: the merged embeddings, then each DeepStack level."""

    tower = Qwen3VLViT  # ours, as the other families' towers
    out_width = "out_hidden_size"  # the merger's output: the LM's width

    def __init__(self, model_dir: str, device: str = "cpu", dtype: torch.dtype = torch.float32, config: Any = None):
        super().__init__(model_dir, device, dtype, config)
        self.levels = len(self.vit.deepstack_merger_list)
        self.hidden_size *= 1 + self.levels  # the width of what forward returns

    def embed(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        embeds, deepstack = self.vit(pixel_values, grid_thw)  # (sum tokens, D), L x (sum tokens, D)
        return torch.cat([embeds, *deepstack], dim=-1)  # (sum tokens, (1 + L) * D): Qwen2-VL's forward splits it


__all__ = ["Qwen3VLVisionEncoder", "deepstack_levels", "qwen3_vl_cost"]
