"""LLaVA's vision tower (CLIP's ViT) and its multimodal projector in plain PyTorch.

The structure follows transformers' CLIP vision model (`CLIPVisionModel` in models/clip/modeling_clip.py: its
embeddings, pre_layrnorm, encoder layers and post_layernorm) and LLaVA's projector (`LlavaMultiModalProjector` in
models/llava/modeling_llava.py): the same modules under the same names and shapes, so that the checkpoint's
`vision_tower.*` and `multi_modal_projector.*` weights load by name (`load_state_dict(strict=True)`), and the same ops
in the same order (transformers' "sdpa" attention), so that the features are transformers' to 1e-5
(tests/encoders/test_llava.py and test_llava_next.py check both).

Ours, not transformers': an Encoder replica builds its tower without importing transformers' modeling, which pulls in
transformers.modeling_utils, torch._dynamo and torch.distributed.tensor (~1.4 CPU-s of a replica's start). So this
module imports torch alone; the configs it takes are transformers' (`config.vision_config`, the LLaVA config), read by
attribute only. (NOTE: with transformers 5.23, LLaVA's config itself pulls in torch._dynamo and
torch.distributed.tensor, through its LlamaConfig's module: see tests/test_replica_imports.py.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from encoders.qwen_vit import ACTIVATIONS


def activation(name: str, what: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' ACT2FN[name] for the names our checkpoints use (CLIP: quick_gelu; LLaVA's projector: gelu)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported {what} {name!r}; supported: {sorted(ACTIVATIONS)}") from None


class ClipEmbeddings(nn.Module):
    """The image's patches (a Conv2d, kernel = stride = the patch, no bias), after a learned class embedding, plus
    a learned position embedding per token (the CLS token's first)."""

    def __init__(self, config: Any):
        super().__init__()
        d, self.patch_size, self.image_size = int(config.hidden_size), int(config.patch_size), int(config.image_size)
        self.class_embedding = nn.Parameter(torch.empty(d))
        self.patch_embedding = nn.Conv2d(
            int(config.num_channels), d, kernel_size=self.patch_size, stride=self.patch_size, bias=False
        )
        self.num_positions = (self.image_size // self.patch_size) ** 2 + 1
        # NOTE: no `position_ids` buffer (transformers' is arange(num_positions), not persistent, so no state_dict
        # has it): looking up every position of the table is the table itself. `_weight` skips the random init, whose
        # normal_ on the meta device imports torch._dynamo (what this module is here to avoid).
        self.position_embedding = nn.Embedding(self.num_positions, d, _weight=torch.empty(self.num_positions, d))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images at the tower's size -> (B, 1 + patches, D)."""
        B, _, H, W = pixel_values.shape
        if (H, W) != (self.image_size, self.image_size):
            raise ValueError(f"images of {H}x{W} px, the vision tower takes {self.image_size}x{self.image_size}")
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)  # (B, patches, D)
        x = torch.cat([self.class_embedding.expand(B, 1, -1), patches], dim=1)  # (B, 1 + patches, D)
        return x + self.position_embedding.weight.unsqueeze(0)


class ClipAttention(nn.Module):
    """Multi-head self-attention over all of an image's tokens (no mask, non-causal): q, k, v and out projections
    with biases, SDPA with head_dim ** -0.5 scaling."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.q_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, n, _ = x.shape
        q, k, v = (
            proj(x).view(B, n, self.num_heads, -1).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)  # (B, heads, n, head_dim)
        return self.out_proj(out.transpose(1, 2).reshape(B, n, -1))  # (B, n, dim)


class ClipMLP(nn.Module):
    """fc1, the config's hidden_act, fc2."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.act = activation(act, "CLIP hidden_act")
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipLayer(nn.Module):
    """Pre-norm transformer layer: x + self_attn(layer_norm1(x)), then x + mlp(layer_norm2(x))."""

    def __init__(self, config: Any):
        super().__init__()
        d, eps = int(config.hidden_size), float(config.layer_norm_eps)
        self.self_attn = ClipAttention(d, int(config.num_attention_heads))
        self.layer_norm1 = nn.LayerNorm(d, eps=eps)
        self.mlp = ClipMLP(d, int(config.intermediate_size), config.hidden_act)
        self.layer_norm2 = nn.LayerNorm(d, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ClipEncoder(nn.Module):
    """The layers, under `layers` (the checkpoint's `encoder.layers.{i}.*`)."""

    def __init__(self, config: Any, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList([ClipLayer(config) for _ in range(num_layers)])


class ClipVisionTower(nn.Module):
    """CLIP's ViT: embeddings, pre_layrnorm, the encoder's layers; `num_layers` of them (default: the config's
    num_hidden_layers), as LLaVA needs only those up to its deepest feature layer. post_layernorm (the pooled CLS
    token's) is held so that the checkpoint loads as it is; LLaVA's features never use it."""

    def __init__(self, config: Any, num_layers: int | None = None):
        super().__init__()
        d, eps = int(config.hidden_size), float(config.layer_norm_eps)
        self.embeddings = ClipEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(d, eps=eps)
        self.encoder = ClipEncoder(config, int(config.num_hidden_layers) if num_layers is None else num_layers)
        self.post_layernorm = nn.LayerNorm(d, eps=eps)

    def forward(self, pixel_values: torch.Tensor, layers: Sequence[int]) -> list[torch.Tensor]:
        """(B, C, H, W) images at the tower's size -> the hidden states at `layers`, each (B, 1 + patches, D), as
        transformers' `hidden_states` index them (0: the embeddings after pre_layrnorm, i: layer i's output). The
        layers past the deepest of them are not run."""
        if not layers or not all(0 <= i <= len(self.encoder.layers) for i in layers):
            raise ValueError(f"hidden states {list(layers)} of a tower of {len(self.encoder.layers)} layers")
        wanted = set(layers)
        h = self.pre_layrnorm(self.embeddings(pixel_values))
        kept = {0: h} if 0 in wanted else {}  # only the selected states are held, not every layer's
        for i, layer in enumerate(self.encoder.layers[: max(wanted)], start=1):
            h = layer(h)
            if i in wanted:
                kept[i] = h
        return [kept[i] for i in layers]


class LlavaProjector(nn.Module):
    """linear_1, projector_hidden_act, linear_2: the vision features (the selected layers' concatenated) -> the LM's
    width. One tensor in, one out (encoders/placement.py may wrap it)."""

    def __init__(self, config: Any):
        super().__init__()
        num_layers = 1 if isinstance(config.vision_feature_layer, int) else len(config.vision_feature_layer)
        d_in, d = int(config.vision_config.hidden_size) * num_layers, int(config.text_config.hidden_size)
        bias = bool(getattr(config, "multimodal_projector_bias", True))
        self.linear_1 = nn.Linear(d_in, d, bias=bias)
        self.act = activation(config.projector_hidden_act, "LLaVA projector_hidden_act")
        self.linear_2 = nn.Linear(d, d, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


__all__ = ["ClipVisionTower", "LlavaProjector"]
