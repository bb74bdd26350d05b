"""A compact Qwen2 / Llama decoder (Qwen2-VL's and LLaVA's language models) over a flat (T, D) token layout.

The module names match the checkpoint's (`layers.0.self_attn.o_proj`, ...), so weights load by name; q/k/v and
gate/up are fused at load (llm/model/layers.py says how).
With `mrope_section=None` the same code is a plain 1-D RoPE decoder; Llama differs from Qwen2 only in which
projections have biases (Qwen2: q/k/v; Llama: `attention_bias` for q/k/v/o, `mlp_bias` for the MLP).
Its input, the prompt's embeddings, takes the images in `merge_image_embeds`: the one merge; their positions, on the
CPU: Qwen2-VL's 3-D M-RoPE from token ids and each image's patch grid (`mrope_positions`), or plain 1-D positions
for LMs without M-RoPE (LLaVA's Llama, `linear_positions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig

from encoders.weights import load_components
from llm.model import hugepages
from llm.model.attention import BatchMeta, KVCache
from llm.model.layers import DecoderLayer, Linear, RMSNorm, Rotary, interleave_rope_rows
from llm.model.parallel import TPGroup, check_divisible


@dataclass(frozen=True, slots=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = True  # Qwen2's q/k/v projections have biases, its o_proj none
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3's RMSNorm of each query and key head before RoPE
    # Qwen3-VL's M-RoPE: the frequencies of the three axes interleaved (t, h, w, t, h, w, ...), not in sections
    mrope_interleaved: bool = False

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, (self.num_heads, self.num_kv_heads)
        if self.mrope_section is not None:
            assert sum(self.mrope_section) == self.head_dim // 2, (self.mrope_section, self.head_dim)
        assert not self.mrope_interleaved or self.mrope_section is not None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> TextConfig:
        return cls.from_hf(AutoConfig.from_pretrained(model_dir))

    @classmethod
    def from_hf(cls, config: Any) -> TextConfig:
        """From the checkpoint's transformers config (the whole model's, or its text part's)."""
        tc = getattr(config, "text_config", config)
        if getattr(tc, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        if (act := getattr(tc, "hidden_act", "silu")) != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; only 'silu' (SwiGLU MLP) is")
        rope = dict(tc.rope_parameters or {})
        # NOTE: transformers 5 keeps Qwen2-VL's legacy `"type": "mrope"` next to `"rope_type": "default"`.
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in ("default", "mrope"):
            raise ValueError(
                f"rope type {rope_type!r} is not supported; only plain RoPE ('default', or Qwen2-VL's "
                f"M-RoPE) is implemented"
            )
        mrope = rope.get("mrope_section")
        # Llama-family configs say which projections have biases; Qwen2's have no such fields (q/k/v biased), nor do
        # Mistral's (none biased).
        model_type = str(getattr(tc, "model_type", ""))
        is_qwen = model_type.startswith("qwen2")
        attention_bias = getattr(tc, "attention_bias", None)
        if not is_qwen and getattr(tc, "sliding_window", None):  # Mistral's window; Qwen2's needs use_sliding_window
            raise ValueError(f"sliding-window attention (window {tc.sliding_window}) is not supported")
        return cls(
            vocab_size=tc.vocab_size,
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_layers=tc.num_hidden_layers,
            num_heads=tc.num_attention_heads,
            num_kv_heads=tc.num_key_value_heads or tc.num_attention_heads,
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            rms_norm_eps=tc.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            mrope_section=tuple(mrope) if mrope else None,
            max_position_embeddings=tc.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=is_qwen if attention_bias is None else bool(attention_bias),
            o_bias=bool(attention_bias),
            mlp_bias=bool(getattr(tc, "mlp_bias", False)),
            qk_norm=model_type.startswith("qwen3"),
            # NOTE: transformers' Qwen3-VL rotary interleaves whatever rope_parameters' mrope_interleaved says
            mrope_interleaved=model_type.startswith("qwen3_vl") and bool(mrope),
        )


class Qwen2LM(nn.Module):
    """The decoder of any TextConfig: Qwen2 (Qwen2-VL) or Llama (LLaVA); the biases and RoPE follow the config.

    With `tp` of N ranks it is one rank's shard (llm/model/parallel.py): its heads, its share of the MLP and of the
    vocabulary in lm_head; only rank 0 has the embedding table."""

    def __init__(self, c: TextConfig, tp: TPGroup = TPGroup()):
        super().__init__()
        self.config, self.tp = c, tp
        # NOTE: built on meta only (from_pretrained assigns the checkpoint's tensors). Given a table, nn.Embedding
        # skips its normal_ init, which on meta runs torch._refs, whose first call imports torch._dynamo: 2.7 CPU-s
        # of an LLM replica's start (tests/test_replica_imports.py).
        self.embed_tokens = (
            nn.Embedding(c.vocab_size, c.hidden_size, _weight=torch.empty(c.vocab_size, c.hidden_size))
            if tp.rank == 0
            else None
        )
        self.layers = nn.ModuleList(DecoderLayer(c, tp) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, tp.rows(c.vocab_size), bias=False)
        self.rotary: Rotary | None = None  # built on the model's device by from_pretrained

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        tp: TPGroup = TPGroup(),
        config: TextConfig | None = None,
    ) -> Qwen2LM:
        """Reads only the language model, its embedding table and lm_head (never the vision weights); with `tp`,
        only this rank's slices of them. `config`: when the caller has it (encoders.ModelSpec)."""
        c = config or TextConfig.from_pretrained(model_dir)
        check_divisible(c.num_heads, c.num_kv_heads, c.intermediate_size, tp.world_size)

        def index(component: str, name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
            if component == "lm_head":
                return tp.index("lm_head.weight", shape)
            if name == "embed_tokens.weight" and tp.rank > 0:  # only rank 0 embeds; a tied lm_head is a slice of it
                return tp.index("lm_head.weight", shape) if c.tie_word_embeddings else None
            return tp.index(name, shape)

        parts = load_components(model_dir, {"text", "lm_head"}, index=index if tp.world_size > 1 else None)
        state = dict(parts["text"])
        lm_head = parts["lm_head"].get("weight")
        if lm_head is None and not c.tie_word_embeddings:
            raise ValueError(f"{model_dir}: no lm_head.weight and tie_word_embeddings is false")
        if lm_head is None:  # tied: rank 0 holds the whole table and slices it; the others read only their slice
            table = state["embed_tokens.weight"] if tp.rank == 0 else state.pop("embed_tokens.weight")
            lm_head = table[tp.index("lm_head.weight", tuple(table.shape))] if tp.rank == 0 else table
        rows = tp.rows(c.vocab_size)
        state["lm_head.weight"] = F.pad(lm_head, (0, 0, 0, rows - lm_head.shape[0]))  # (V / N, D), the last padded
        with torch.device("meta"):
            model = cls(c, tp)
        model.load_state_dict(fuse_projections(state, c.num_layers, c.head_dim), strict=True, assign=True)
        model = model.to(device=device, dtype=dtype).eval()
        if torch.device(device).type == "cpu":  # a decode step streams every weight: huge pages (hugepages.py)
            hugepages.move_parameters(model)
        model.rotary = Rotary(
            c.head_dim, c.rope_theta, c.max_position_embeddings, c.mrope_section, device, c.mrope_interleaved
        )
        return model

    def new_cache(self, num_blocks: int, block_size: int) -> KVCache:
        c, p = self.config, self.lm_head.weight
        nkv = c.num_kv_heads // self.tp.world_size  # this rank's KV heads
        return KVCache.allocate(c.num_layers, num_blocks, block_size, nkv, c.head_dim, p.device, p.dtype)

    def kv_bytes_per_token(self) -> int:
        """Of this rank's shard: the cache budget is per device."""
        c = self.config
        nkv = c.num_kv_heads // self.tp.world_size
        return KVCache.bytes_per_token(c.num_layers, nkv, c.head_dim, self.lm_head.weight.dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids.to(self.embed_tokens.weight.device))  # (T, D)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        meta: BatchMeta,
        deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """A flat batch of chunks: inputs_embeds (T, D), positions (3, T) -> final hidden states (T, D).
        `deepstack` (Qwen3-VL): (rows (R,), features (R, L, D)): after layer l < L, the hidden states of the image
        rows `rows` get their level-l features added (transformers' `_deepstack_process`; the DeepStack paper)."""
        attn = self.layers[0].self_attn
        cis = self.rotary.step(positions.to(self.lm_head.weight.device), attn.nh, attn.nkv)  # once per step
        x, delta = inputs_embeds.clone(), None  # the residual stream, summed in place by the layers
        for i, layer in enumerate(self.layers):
            delta = layer(x, delta, cis, cache.kv[i], meta)
            if deepstack is not None and i < deepstack[1].shape[1]:  # into the stream: the layer's output is x + delta
                x.index_add_(0, deepstack[0], deepstack[1][:, i].to(x.dtype))
        return self.norm(x, delta)

    def logits(self, hidden: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """Of the rows `rows` of hidden (all of them if None); one rank's: llm/model/parallel.py gathers them."""
        assert self.tp.world_size == 1, "ParallelLM.logits gathers the vocabulary slices of the ranks"
        return self.lm_head(hidden if rows is None else hidden[rows]).float()  # (B, V)


def fuse_projections(state: dict[str, torch.Tensor], num_layers: int, head_dim: int) -> dict[str, torch.Tensor]:
    """The checkpoint's q/k/v and gate/up tensors (whole, or this rank's slices) as the fused qkv_proj and
    gate_up_proj, q and k rows interleaved per head for the complex RoPE (llm/model/layers.py), and so the q and k
    norms' weights (Qwen3)."""
    out = dict(state)
    for i in range(num_layers):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        for norm in ("q_norm", "k_norm"):
            if f"{a}{norm}.weight" in out:
                out[f"{a}{norm}.weight"] = interleave_rope_rows(out[f"{a}{norm}.weight"], head_dim)
        for kind in ("weight", "bias"):
            if f"{a}q_proj.{kind}" in out:
                q, k, v = (out.pop(f"{a}{n}_proj.{kind}") for n in "qkv")
                out[f"{a}qkv_proj.{kind}"] = torch.cat(
                    [interleave_rope_rows(q, head_dim), interleave_rope_rows(k, head_dim), v]
                )
            if f"{m}gate_proj.{kind}" in out:
                out[f"{m}gate_up_proj.{kind}"] = torch.cat(
                    [out.pop(f"{m}gate_proj.{kind}"), out.pop(f"{m}up_proj.{kind}")]
                )
    return out


def merge_image_embeds(
    inputs_embeds: torch.Tensor, is_multimodal: torch.Tensor, image_embeds: torch.Tensor
) -> torch.Tensor:
    """The one merge: image embeddings into the text embeddings at the placeholder positions.
    inputs_embeds (T, D), is_multimodal (T,) bool on the CPU, image_embeds (N, D) -> (T, D)."""
    n_placeholders = int(is_multimodal.sum())  # counted on the CPU ids: no device sync
    if image_embeds.shape[0] != n_placeholders:
        raise ValueError(f"{image_embeds.shape[0]} image embeddings for {n_placeholders} placeholder tokens")
    if n_placeholders == 0:
        return inputs_embeds
    if image_embeds.shape[1] != inputs_embeds.shape[1]:
        raise ValueError(
            f"image embeddings have width {image_embeds.shape[1]}, the LM hidden size is {inputs_embeds.shape[1]}"
        )
    mask = is_multimodal.to(inputs_embeds.device, non_blocking=True).unsqueeze(-1)  # (T, 1)
    return inputs_embeds.masked_scatter(mask, image_embeds.to(inputs_embeds.device, inputs_embeds.dtype))


def mrope_positions(
    input_ids: torch.Tensor,
    image_token_id: int,
    image_grid_thw: list[tuple[int, int, int]],
    merge_size: int,
    *,
    video_token_id: int | None = None,
    time_intervals: list[float | None] | None = None,
) -> tuple[torch.Tensor, int]:
    """input_ids (T,) -> positions (3, T) and the rope delta (decode position = cache length + delta).

    Text advances all three axes together; an image's (or video's) tokens take (t, row, col) offsets from the
    position where it starts, and the text after it continues from that position + max(rows, cols) of merged
    patches (transformers' get_rope_index of the pinned 5.23; the Qwen2-VL paper's and the original Qwen code's
    rule is the item's largest position + 1, which differs for a video with more tubelets than rows and columns).
    A video's temporal offset of tubelet i is int(i * interval): `time_intervals` per item, None or absent: 1
    (Qwen2-VL's arange(t); an image has t = 1); Qwen2.5-VL's is tokens_per_second * second_per_grid_t, multiplied
    before the truncation. Placeholders are `image_token_id` and `video_token_id`, items in prompt order, each
    one contiguous, complete run (never a part of an item).
    """
    # Adapted from get_rope_index and get_vision_position_ids in transformers/models/qwen2_vl/modeling_qwen2_vl.py.
    T = input_ids.shape[0]
    is_placeholder = input_ids == image_token_id
    if video_token_id is not None:
        is_placeholder |= input_ids == video_token_id
    placeholder_idx = is_placeholder.nonzero().flatten().tolist()
    positions = torch.empty(3, T, dtype=torch.long)
    cursor = next_pos = k = 0
    for i, (t, h, w) in enumerate(image_grid_thw):
        gh, gw = h // merge_size, w // merge_size
        n = t * gh * gw
        if k + n > len(placeholder_idx):
            raise ValueError(f"image {i} needs {n} placeholder tokens, {len(placeholder_idx) - k} are left")
        s = placeholder_idx[k]
        if placeholder_idx[k + n - 1] != s + n - 1:
            raise ValueError(f"the {n} placeholder tokens of image {i} are not one contiguous run")
        positions[:, cursor:s] = torch.arange(next_pos, next_pos + s - cursor)
        next_pos += s - cursor
        interval = time_intervals[i] if time_intervals else None
        # NOTE: in float32, as transformers multiplies arange(t) by a float32 second_per_grid_ts tensor
        temporal = torch.arange(t) if interval is None else (torch.arange(t) * _f32(interval)).long()
        grid = torch.stack(torch.meshgrid(temporal, torch.arange(gh), torch.arange(gw), indexing="ij"))
        positions[:, s : s + n] = grid.reshape(3, n) + next_pos  # (3, n)
        next_pos += max(gh, gw)
        cursor, k = s + n, k + n
    if k != len(placeholder_idx):
        raise ValueError(f"{len(placeholder_idx)} placeholder tokens for {k} image embedding rows")
    positions[:, cursor:] = torch.arange(next_pos, next_pos + T - cursor)
    rope_delta = int(positions.max()) + 1 - T if T else 0
    return positions, rope_delta


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def video_time_interval(second_per_grid_t: float, tokens_per_second: float | None) -> float | None:
    """Qwen2.5-VL's temporal step per tubelet (its vision config's tokens_per_second times the video's seconds per
    tubelet, in float32 as transformers computes it); None (a step of 1) for Qwen2-VL, which has none."""
    if tokens_per_second is None:
        return None
    return float(tokens_per_second * _f32(second_per_grid_t))


def linear_positions(input_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """input_ids (T,) -> positions (3, T), all three rows 0..T-1 (a 1-D RoPE reads the first), rope delta 0."""
    return torch.arange(input_ids.shape[0]).expand(3, -1), 0  # (3, T)


__all__ = [
    "Qwen2LM",
    "TextConfig",
    "fuse_projections",
    "linear_positions",
    "merge_image_embeds",
    "mrope_positions",
    "video_time_interval",
]
