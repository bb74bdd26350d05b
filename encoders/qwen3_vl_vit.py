"""Qwen3-VL's vision tower (the ViT, its patch merger and its DeepStack mergers) in plain PyTorch.

The structure follows transformers' `Qwen3VLVisionModel` (models/qwen3_vl/modeling_qwen3_vl.py, with the grid helpers
of vision_utils.py): the same modules under the same names and shapes, so that the checkpoint's `model.visual.*`
weights (prefix stripped) load by name (`load_state_dict(strict=True, assign=True)`), and the same ops in the same
order, so that the merged embeddings and every DeepStack level are transformers' (tests/encoders/
test_qwen3_vl_tower.py checks both, fp32 and bf16).

What it adds to Qwen2-VL's tower (encoders/qwen_vit.py, whose attention, blocks, grid and segment helpers it reuses):
a bias on the patch embedding; learned absolute position embeddings, a square table resampled (bilinear, corners
aligned) to each image's patch grid and added after the patch embedding; LayerNorm blocks with a `linear_fc1`/
`linear_fc2` MLP; and DeepStack: after each block of `deepstack_visual_indexes`, its own merger (normalized after the
merge-block shuffle, over the 4 patches' concatenation) turns the hidden states into one more set of LM-width tokens,
which the LM adds to its first layers' hidden states at the image's positions.

Ours, not transformers': an Encoder replica builds its tower without importing transformers' modeling (see
encoders/qwen_vit.py). So this module imports torch alone; the config it takes is transformers'
`config.vision_config` (or anything with its attributes: a ConfigView, a SimpleNamespace), read by attribute only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from encoders.qwen_vit import (
    AxialRotary,
    VisionAttention,
    VisionBlock,
    activation,
    frame_lengths,
    grids_of,
    position_ids,
)


class PatchEmbed(nn.Module):
    """Each patch's C x T x p x p pixels -> one vector: a Conv3d with kernel = stride = the patch, with a bias
    (Qwen2-VL's has none). NOTE: a Conv3d, not the equivalent matmul, for qwen_vit.PatchEmbed's reason (parity)."""

    def __init__(self, patch_size: int, temporal_patch_size: int, in_channels: int, embed_dim: int):
        super().__init__()
        self.shape = (in_channels, temporal_patch_size, patch_size, patch_size)
        self.embed_dim = embed_dim
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, embed_dim, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = pixel_values.view(-1, *self.shape).to(self.proj.weight.dtype)  # (N, C, T, p, p)
        return self.proj(x).view(-1, self.embed_dim)  # (N, embed_dim)


class VisionMLP(nn.Module):
    """linear_fc1, the activation (Qwen3-VL's: gelu_pytorch_tanh), linear_fc2."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class PatchMerger(nn.Module):
    """Each merge x merge block of patches (consecutive rows) -> one LM token: LayerNorm, then Linear, GELU (erf),
    Linear over the block's concatenated vectors. The final merger normalizes each patch before the concatenation;
    the DeepStack mergers (`postshuffle`) normalize the concatenation, over merge**2 x the width."""

    def __init__(self, context_dim: int, merge: int, out_dim: int, postshuffle: bool):
        super().__init__()
        self.width = context_dim * merge**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else context_dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.width, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


def interpolation_taps(positions: torch.Tensor, extents: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear resampling (corners aligned) of a side x side table onto each patch's grid: ((n, 4) int64 rows of the
    flattened table, (n, 4) float32 weights), the taps (top-left, top-right, bottom-left, bottom-right) of the
    patches at `positions` ((n, 2) row, column) in grids of `extents` ((n, 2) height, width).

    Corners aligned: a grid's first and last rows sit on the table's first and last (an axis of one patch on the
    first), so row r of h sits at r * (side - 1) / (h - 1) of the table. The float32 arithmetic is transformers' own,
    op for op (vision_utils.get_vision_interpolation_indices_and_weights): the weights are fed to the embeddings as
    they are, and bit-equal weights keep fp32 parity exact."""
    at = positions.float() * (side - 1) / (extents - 1).clamp(min=1)  # (n, 2): where each patch sits in the table
    below = at.floor()
    near = 1 - (at - below)  # the weight of the tap below (or at) the position, per axis
    weights = torch.stack([near, 1 - near], dim=-1)  # (n, 2 axes, 2 taps)
    # NOTE: the tap above is clamped to the table (it has weight 0 there: the position is the last row itself).
    taps = torch.stack([below.long(), (below.long() + 1).clamp(max=side - 1)], dim=-1)
    indices = (taps[:, 0, :, None] * side + taps[:, 1, None, :]).flatten(1)  # (n, 4): rows x columns
    return indices, (weights[:, 0, :, None] * weights[:, 1, None, :]).flatten(1)


class Qwen3VLViT(nn.Module):
    """Qwen3-VL's vision tower: Conv3d patch embedding plus interpolated learned position embeddings, `depth`
    LayerNorm blocks of full attention within each image (each frame of a video: two frames per temporal patch) with
    2-D rotary, then the merger into the LM's width (`out_hidden_size`); after each block of
    `deepstack_visual_indexes`, its DeepStack merger into that width too."""

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        d, heads = int(config.hidden_size), int(config.num_heads)
        out, self.merge = int(config.out_hidden_size), int(config.spatial_merge_size)
        depth = int(config.depth)
        self.patch_embed = PatchEmbed(
            int(config.patch_size), int(config.temporal_patch_size), int(config.in_channels), d
        )
        count = int(config.num_position_embeddings)
        self.side = math.isqrt(count)
        if self.side**2 != count:
            raise ValueError(f"num_position_embeddings {count} is not a square grid of positions")
        self.pos_embed = nn.Embedding(count, d)

        def block() -> VisionBlock:
            norms = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
            return VisionBlock(
                *norms, VisionAttention(d, heads), VisionMLP(d, int(config.intermediate_size), config.hidden_act)
            )

        self.blocks = nn.ModuleList(block() for _ in range(depth))
        self.merger = PatchMerger(d, self.merge, out, postshuffle=False)
        # NOTE: transformers emits a level after each block that is in the list, in block order, with the merger of
        # its first place in the list: the config's order only for increasing, distinct indexes (the released
        # checkpoints': [8, 16, 24], ...). Anything else would hand the LM its levels reordered or fewer: refused here.
        levels = [int(i) for i in config.deepstack_visual_indexes]
        if levels != sorted(set(levels)) or any(not 0 <= i < depth for i in levels):
            raise ValueError(f"deepstack_visual_indexes {levels} must be increasing block indexes below {depth}")
        self.deepstack = dict(zip(levels, range(len(levels))))  # block -> its merger
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(d, self.merge, out, postshuffle=True) for _ in levels)
        self.rotary = AxialRotary(config, d)  # Qwen2-VL's 2-D rope

    def position_embeddings(self, positions: torch.Tensor, extents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(n, hidden_size) in `dtype`: the learned table resampled at each patch. The weighted sum is float32 (the
        bf16 table's rows times float32 weights) and rounded once, at the end, as transformers does."""
        indices, weights = interpolation_taps(positions, extents, self.side)
        device = self.pos_embed.weight.device
        rows = self.pos_embed(indices.to(device))  # (n, 4, hidden_size)
        return (rows * weights.to(device)[:, :, None]).sum(1).to(dtype)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values (sum t*h*w, C*T*p*p), grid_thw (n, 3) -> (the images' merged tokens, in order: (sum t*h*w /
        merge**2, out_hidden_size); the DeepStack levels, one a `deepstack_visual_indexes` entry, in its order, each
        of that shape)."""
        grids = grids_of(grid_thw)
        patches = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape[0] != patches:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows, grid_thw {grids} has {patches} patches")
        # Each patch's (row, column) in its frame, in the preprocessing's merge-block order, every frame of a
        # video at the same ones; and its frame's (height, width): both on the CPU.
        positions = position_ids(grids, self.merge)
        extents = torch.tensor([(h, w) for t, h, w in grids]).repeat_interleave(
            torch.tensor([t * h * w for t, h, w in grids]), dim=0
        )
        x = self.patch_embed(pixel_values)
        x = x + self.position_embeddings(positions, extents, x.dtype)
        cos, sin = self.rotary(positions, x.device)
        lengths = frame_lengths(grids)  # NOTE: each frame its own segment, as transformers' cu_seqlens
        deepstack = []
        for i, blk in enumerate(self.blocks):
            x = blk(x, lengths, cos, sin)
            if i in self.deepstack:
                deepstack.append(self.deepstack_merger_list[self.deepstack[i]](x))
        return self.merger(x), deepstack


__all__ = ["Qwen3VLViT", "interpolation_taps"]
