"""Qwen2-VL's and Qwen2.5-VL's vision towers (the ViT and its patch merger) in plain PyTorch.

The structure follows transformers' Qwen2-VL / Qwen2.5-VL vision towers (`Qwen2VisionTransformerPretrainedModel` in
models/qwen2_vl/modeling_qwen2_vl.py, `Qwen2_5_VisionTransformerPretrainedModel` in models/qwen2_5_vl/, the grid
helpers of vision_utils.py): the same modules under the same names and shapes, so that the checkpoint's `visual.*`
weights load by name (`load_state_dict(strict=True)`), and the same ops in the same order, so that the embeddings are
transformers' to 1e-5 (tests/encoders/test_qwen2_vl.py and test_qwen2_5_vl.py check both).

Ours, not transformers': an Encoder replica builds its tower without importing transformers' modeling, which pulls in
transformers.modeling_utils, torch._dynamo and torch.distributed.tensor (1.4-2 CPU-s of each replica's start). So this
module imports torch alone; the configs it takes are transformers' (`config.vision_config`), read by attribute only.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's sigmoid approximation of GELU (Qwen2-VL's ViT MLP)."""
    return x * torch.sigmoid(1.702 * x)


# The `hidden_act` values the Qwen2-VL / Qwen2.5-VL vision configs use (Qwen2-VL: quick_gelu; Qwen2.5-VL: silu), with
# the definitions transformers' ACT2FN gives these names.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,  # exact (erf)
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported vision hidden_act {name!r}; supported: {sorted(ACTIVATIONS)}") from None


def rope_theta(config: Any) -> float:
    """The vision rotary base: `rope_parameters["rope_theta"]` (transformers 5 fills it in: 10000 for both towers),
    else 10000, the value the Qwen ViTs were trained with."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "axial")
    if rope_type != "axial":
        raise ValueError(f"the Qwen vision towers use axial 2-D rope, the config asks for {rope_type!r}")
    return float(params.get("rope_theta", 10000.0))


def grids_of(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


def position_ids(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(sum t*h*w, 2) int64 on the CPU: each patch's (row, column) in its image, in the preprocessing's row order
    (merge x merge blocks, row-major, each block row-major), every frame of a video at the same positions."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h).view(h, 1).expand(h, w)
        cols = torch.arange(w).view(1, w).expand(h, w)
        # (h, w) -> (h/m, m, w/m, m) -> (h/m, w/m, m, m): the blocks' order
        rc = [x.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten() for x in (rows, cols)]
        out.append(torch.stack(rc, dim=-1).repeat(t, 1))
    return torch.cat(out)


def frame_lengths(grids: list[tuple[int, int, int]]) -> list[int]:
    """The full-attention segments: each image, each frame of a video (cu_seqlens' differences)."""
    return [h * w for t, h, w in grids for _ in range(t)]


def window_order(grids: list[tuple[int, int, int]], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's window attention: (the merged tokens' order, grouped by window: an int64 CPU tensor over all
    images' merged tokens; the windows' lengths in patches). `window`: a window's side in merged tokens. Each frame's
    merged-token grid is cut into window x window tiles from its top-left corner (the last row and column of tiles
    partial); the tokens go tile by tile (tiles row-major, frames in order), row-major within a tile. The same order
    and lengths as transformers' get_vision_window_index (its index and cu_window_seqlens)."""
    orders, lengths, offset = [], [], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge  # the merged-token grid
        nh, nw = -(-gh // window), -(-gw // window)  # tiles down and across
        tile = ((torch.arange(gh) // window).view(gh, 1) * nw + (torch.arange(gw) // window).view(1, gw)).flatten()
        key = (torch.arange(t).view(t, 1) * (nh * nw) + tile.view(1, -1)).flatten()  # (t*gh*gw,): frame, tile
        # NOTE: stable, so row-major order within a tile; every tile holds a token (ceil division), none is empty.
        orders.append(torch.argsort(key, stable=True) + offset)
        lengths += (torch.bincount(key, minlength=t * nh * nw) * merge**2).tolist()
        offset += t * gh * gw
    return torch.cat(orders), lengths


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class PatchEmbed(nn.Module):
    """Each patch's C x T x p x p pixels -> one vector: a Conv3d with kernel = stride = the patch, no bias.

    NOTE: a Conv3d, not the equivalent matmul: the matmul's different summation order broke 1e-5 parity."""

    def __init__(self, patch_size: int, temporal_patch_size: int, in_channels: int, embed_dim: int):
        super().__init__()
        self.shape = (in_channels, temporal_patch_size, patch_size, patch_size)
        self.embed_dim = embed_dim
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, embed_dim, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = pixel_values.view(-1, *self.shape).to(self.proj.weight.dtype)  # (N, C, T, p, p)
        return self.proj(x).view(-1, self.embed_dim)  # (N, embed_dim)


class RMSNorm(nn.Module):
    """Qwen2.5-VL's: normalized in float32, cast back, then scaled."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class VisionAttention(nn.Module):
    """Multi-head self-attention over packed patches: fused q/k/v, 2-D rotary on q and k (in float32), attention only
    within each segment (an image, a frame, a window: `lengths`), non-causal."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # each (n, heads, head_dim)
        dtype = q.dtype
        q, k = q.float(), k.float()
        q = (q * cos + rotate_half(q) * sin).to(dtype)
        k = (k * cos + rotate_half(k) * sin).to(dtype)
        q, k, v = (y.transpose(0, 1).unsqueeze(0) for y in (q, k, v))  # (1, heads, n, head_dim)
        if len(lengths) == 1:
            out = F.scaled_dot_product_attention(q, k, v, scale=self.scale).transpose(1, 2)
        else:
            # NOTE: one SDPA call a segment, as transformers' sdpa path does: one call with a block-diagonal mask
            # would compute (and mask) every cross-segment score.
            parts = zip(q.split(lengths, dim=2), k.split(lengths, dim=2), v.split(lengths, dim=2))
            out = torch.cat(
                [F.scaled_dot_product_attention(qi, ki, vi, scale=self.scale).transpose(1, 2) for qi, ki, vi in parts],
                dim=1,
            )
        return self.proj(out.reshape(n, -1))  # (n, dim)


class VisionMLP(nn.Module):
    """Qwen2-VL's: fc1, the activation, fc2."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedMLP(nn.Module):
    """Qwen2.5-VL's: down(act(gate(x)) * up(x)), with biases."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, norm1: nn.Module, norm2: nn.Module, attn: VisionAttention, mlp: nn.Module):
        super().__init__()
        self.norm1, self.norm2, self.attn, self.mlp = norm1, norm2, attn, mlp

    def forward(self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), lengths, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge x merge block of patches (consecutive rows) -> one LM token: ln_q, then Linear, GELU, Linear over
    the block's concatenated vectors. One tensor in, one out (encoders/placement.py may wrap it)."""

    def __init__(self, out_dim: int, context_dim: int, merge: int, ln_q: nn.Module):
        super().__init__()
        self.width = context_dim * merge**2
        self.ln_q = ln_q
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class AxialRotary:
    """2-D axial rope: a quarter of each head's dims rotate with the row, a quarter with the column, each half of the
    head (rotate_half's pairs) with both. The frequencies are computed on the CPU, in float32, whatever the device the
    tower is built on (meta, before the weights are assigned) or its dtype: not a buffer, so neither state_dict,
    `.to(meta)` nor `.to(bfloat16)` touches them (a bf16 inv_freq would misplace patches). Every Qwen tower's."""

    def __init__(self, config: Any, width: int):
        half = width // int(config.num_heads) // 2
        exponent = torch.arange(0, half, 2, dtype=torch.float32, device="cpu") / half
        self.inv_freq = 1.0 / (rope_theta(config) ** exponent)  # (head_dim / 4,)

    def __call__(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (n, 1, head_dim), float32 on `device`, of the patches at `positions` ((n, 2) rows, columns)."""
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
        angles = positions.to(device).unsqueeze(-1).float() * self.inv_freq  # (n, 2, head_dim / 4)
        cos, sin = angles.cos(), angles.sin()
        # [rows, columns] for each half of the head
        cos = torch.cat([cos[:, 0], cos[:, 1], cos[:, 0], cos[:, 1]], dim=-1).unsqueeze(1)
        sin = torch.cat([sin[:, 0], sin[:, 1], sin[:, 0], sin[:, 1]], dim=-1).unsqueeze(1)
        return cos, sin


class _QwenViT(nn.Module):
    """What both towers share: the patch embedding, the blocks, the merger, the rotary angles."""

    def __init__(self, config: Any, width: int, out_dim: int, blocks: list[VisionBlock], ln_q: nn.Module):
        super().__init__()
        self.config = config
        self.merge = int(config.spatial_merge_size)
        self.patch_embed = PatchEmbed(
            int(config.patch_size), int(config.temporal_patch_size), int(config.in_channels), width
        )
        self.blocks = nn.ModuleList(blocks)
        self.merger = PatchMerger(out_dim, width, self.merge, ln_q)
        self.rotary = AxialRotary(config, width)

    def _check(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> None:
        patches = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape[0] != patches:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows, grid_thw {grids} has {patches} patches")


class Qwen2VLViT(_QwenViT):
    """Qwen2-VL's vision tower: Conv3d patch embedding, `depth` LayerNorm blocks of full attention within each image
    (each frame of a video) and a `hidden_act` MLP of embed_dim x mlp_ratio, then the LayerNorm patch merger into the
    LM's width (`hidden_size`)."""

    def __init__(self, config: Any):
        d, heads = int(config.embed_dim), int(config.num_heads)

        def block() -> VisionBlock:
            norms = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
            return VisionBlock(
                *norms, VisionAttention(d, heads), VisionMLP(d, int(d * config.mlp_ratio), config.hidden_act)
            )

        blocks = [block() for _ in range(int(config.depth))]
        super().__init__(config, d, int(config.hidden_size), blocks, nn.LayerNorm(d, eps=1e-6))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values (sum t*h*w, C*T*p*p), grid_thw (n, 3) -> (sum t*h*w / merge**2, hidden_size): the images'
        merged tokens, in order."""
        grids = grids_of(grid_thw)
        self._check(pixel_values, grids)
        x = self.patch_embed(pixel_values)
        cos, sin = self.rotary(position_ids(grids, self.merge), x.device)
        lengths = frame_lengths(grids)
        for blk in self.blocks:
            x = blk(x, lengths, cos, sin)
        return self.merger(x)


class Qwen2_5_VLViT(_QwenViT):
    """Qwen2.5-VL's vision tower: Conv3d patch embedding, `depth` RMSNorm blocks with a gated (SwiGLU-style) MLP,
    attending within windows of window_size px except the `fullatt_block_indexes` blocks (within each image, each
    frame), then the RMSNorm patch merger into the LM's width (`out_hidden_size`). The patches run in window order
    (whole merge blocks moved); the merged tokens are put back in the image's order at the end."""

    def __init__(self, config: Any):
        d, heads, inter = int(config.hidden_size), int(config.num_heads), int(config.intermediate_size)

        def block() -> VisionBlock:
            norms = RMSNorm(d, eps=1e-6), RMSNorm(d, eps=1e-6)
            return VisionBlock(*norms, VisionAttention(d, heads), GatedMLP(d, inter, config.hidden_act))

        blocks = [block() for _ in range(int(config.depth))]
        super().__init__(config, d, int(config.out_hidden_size), blocks, RMSNorm(d, eps=1e-6))
        self.full_attention = frozenset(int(i) for i in config.fullatt_block_indexes)
        self.window = int(config.window_size) // self.merge // int(config.patch_size)  # in merged tokens

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values (sum t*h*w, C*T*p*p), grid_thw (n, 3) -> (sum t*h*w / merge**2, out_hidden_size): the
        images' merged tokens, in order."""
        grids = grids_of(grid_thw)
        self._check(pixel_values, grids)
        order, windows = window_order(grids, self.merge, self.window)  # over merged tokens, on the CPU
        unit = self.merge**2
        x = self.patch_embed(pixel_values)
        n = x.shape[0]
        x = x.view(n // unit, unit, -1)[order.to(x.device)].view(n, -1)  # whole merge blocks, in window order
        positions = position_ids(grids, self.merge).view(-1, unit, 2)[order].view(n, 2)
        cos, sin = self.rotary(positions, x.device)
        frames = frame_lengths(grids)  # NOTE: window order keeps each frame's tokens together
        for i, blk in enumerate(self.blocks):
            x = blk(x, frames if i in self.full_attention else windows, cos, sin)
        merged = self.merger(x)
        return merged[torch.argsort(order).to(merged.device)]


__all__ = ["ACTIVATIONS", "Qwen2VLViT", "Qwen2_5_VLViT", "position_ids", "window_order"]
