"""The decoder's layers, written for few ops per layer in a decode step: fused q/k/v and gate/up projections, RoPE
as one complex multiply in place, one KV write, a residual carried beside one-op RMSNorms.

Same math as transformers' Qwen2 / Llama; the differences are in layout only:
- q_proj, k_proj, v_proj are one `qkv_proj` (and gate_proj, up_proj one `gate_up_proj`), concatenated at load.
- Within each q and k head the rows are interleaved at load ((0, hd/2), (1, hd/2 + 1), ...), so that RoPE's
  rotate-half pairs are adjacent and the rotation is a complex multiply (the layout Meta's original Llama and
  gpt-fast use). q and k are permuted alike, so every q.k, and so attention, is unchanged; the cache holds keys
  in that order.
- 1/sqrt(head_dim) is folded into the queries' rotation, so attention applies no scale of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llm.model import cpu_kernels, hugepages, triton_fused, triton_gemm
from llm.model.attention import BatchMeta, paged_attention
from llm.model.gemm_kernel import NO_FOLD, Fold, RopeKV
from llm.model.parallel import TPGroup


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of the residual stream x (T, D), after adding `delta` to x in place (the residual carried
        into the norm: one op with the CPU kernels, two without)."""
        if cpu_kernels.on(x):
            return cpu_kernels.add_rms_norm(x, delta, self.weight, self.eps)
        if triton_fused.on(x):
            return triton_fused.add_rms_norm(x, delta, self.weight, self.eps)
        if delta is not None:
            x.add_(delta)
        return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one op (float32 inside)


def interleave_rope_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows (or bias entries) of a q or k projection, per head: (0, hd/2), (1, hd/2 + 1), ... (see above)."""
    half = head_dim // 2
    perm = torch.stack([torch.arange(half), torch.arange(half) + half], -1).flatten()  # (hd,)
    return w.view(-1, head_dim, *w.shape[1:])[:, perm].reshape(w.shape)


class Rotary:
    """RoPE as unit complex numbers, one table row per position (cos and sin of position * inv_freq in float32, as
    transformers computes them), kept as real pairs (P, hd/2, 2). M-RoPE takes each frequency from its own axis:
    in sections (Qwen2-VL, Qwen2.5-VL) or interleaved (Qwen3-VL)."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_positions: int,
        mrope_section: tuple[int, ...] | None,
        device: torch.device | str = "cpu",
        interleaved: bool = False,
    ):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # (hd/2,)
        angles = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq  # (P, hd/2)
        self.table = torch.stack([angles.cos(), angles.sin()], -1).to(device)  # (P, hd/2, 2)
        sections = mrope_section or (head_dim // 2,)
        if interleaved:  # Qwen3-VL: frequency i is h's where i % 3 == 1 (the first 3 * sections[1]), w's where 2
            i = torch.arange(head_dim // 2)
            axis = torch.where((i % 3 == 1) & (i < 3 * sections[1]), 1, 0)
            axis = torch.where((i % 3 == 2) & (i < 3 * sections[2]), 2, axis)
        else:  # Qwen2-VL: a section of frequencies per axis, t's first
            axis = torch.cat([torch.full((n,), k % 3) for k, n in enumerate(sections)])  # (hd/2,) which axis
        self.axis, self.freq = axis.to(device), torch.arange(head_dim // 2, device=device)
        self.scale = head_dim**-0.5

    def step(self, positions: torch.Tensor, nh: int, nkv: int) -> torch.Tensor:
        """positions (3, T) -> (T, nh + nkv, hd/2, 2): the queries' rotations (scaled), then the keys'."""
        cis = self.table[positions[self.axis].T, self.freq]  # (T, hd/2, 2): frequency i at its axis's position
        T = cis.shape[0]
        return torch.cat([(cis * self.scale)[:, None].expand(T, nh, -1, -1), cis[:, None].expand(T, nkv, -1, -1)], 1)

    @staticmethod
    def apply_(qkv: torch.Tensor, cis: torch.Tensor) -> None:
        """Rotate the q and k heads of qkv (T, H, hd) in place by cis (T, nh + nkv, hd/2, 2)."""
        n = cis.shape[1]
        if torch.compiler.is_compiling():  # Inductor generates no complex code: the same product in real pairs
            x = qkv[:, :n].unflatten(-1, (-1, 2)).float()  # (T, n, hd/2, 2)
            c, s = cis[..., 0], cis[..., 1]
            out = torch.stack([x[..., 0] * c - x[..., 1] * s, x[..., 0] * s + x[..., 1] * c], -1)
            qkv[:, :n] = out.flatten(-2).to(qkv.dtype)
        elif qkv.dtype in (torch.float32, torch.float64):  # one complex multiply, in place
            torch.view_as_complex(qkv.unflatten(-1, (-1, 2)))[:, :n].mul_(torch.view_as_complex(cis))
        else:  # no complex bfloat16: rotate in float32 (as transformers' cos/sin are) and write back
            qk = torch.view_as_complex(qkv[:, :n].float().unflatten(-1, (-1, 2))).mul_(torch.view_as_complex(cis))
            qkv[:, :n] = torch.view_as_real(qk).flatten(-2)


class Linear(nn.Linear):
    """nn.Linear whose GEMMs read a packed copy of the weight once `pack_linears` made one (ours or oneDNN's), and
    whose bfloat16 decode rows otherwise go to the CPU kernel (cpu_kernels.py) where it is built."""

    packed: tuple[torch.Tensor, ...] | None = None  # the weight's packed column chunks (one unless shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.weight, self.bias, self.packed)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed, gated=False) -> torch.Tensor:
    """A decode step's few rows on cuda by triton_gemm (where it measured faster than cuBLAS); else the CPU kernels'
    or torch's linear. gated (where triton_fused runs): x is an MLP's (gate, up), multiplied as SiLU(gate) * up."""
    fold = Fold(gated=True) if gated else NO_FOLD
    if triton_gemm.on(x, weight, fold):
        return triton_gemm.linear(x, weight, bias, fold)
    return cpu_kernels.linear(triton_fused.silu_mul(x) if gated else x, weight, bias, packed)


def pack_linears(model: nn.Module, chunks: int = 1) -> int:
    """A packed copy of every CPU linear weight of model whose dtype can be packed here (`cpu_kernels.can_pack`:
    float32; bfloat16 on CPUs with oneDNN's bfloat16 kernels); returns how many. oneDNN's in `chunks` column chunks
    (cpu_kernels.pack_chunks), which a linear called on one thread shares with the helper thread
    (`cpu_kernels.use_helper`); 1: whole. The weights
    themselves stay (the reference path, torch.compile, tensor-parallel loading read them)."""
    linears = [m for m in model.modules() if isinstance(m, Linear | RowParallelLinear)]
    todo = [m for m in linears if m.weight.device.type == "cpu" and cpu_kernels.can_pack(m.weight.dtype)]
    if not todo:
        return 0
    for m in todo:
        m.packed = cpu_kernels.pack_chunks(m.weight, chunks)
    # NOTE: the copies are what a decode step streams, and oneDNN's allocations are on 4 KiB pages: on huge pages
    # the bench model's batch-1 step measured 5.6 ms steady against 5.7-6.7 (bfloat16), 9.2-9.8 against 10.2-11.7
    # (float32). hugepages.collapse backs them after the fact (our panels are allocated on them).
    onednn = [p for m in todo for p in m.packed if p.is_mkldnn]
    spans = [(torch.ops.mkldnn.data_ptr(p), p.numel() * p.element_size()) for p in onednn]
    hugepages.collapse(spans)
    return len(todo)


class RowParallelLinear(nn.Module):
    """nn.Linear over this rank's slice of the input features: the ranks' partial products are summed (one
    all-reduce), then the bias is added once. With one rank it is nn.Linear."""

    packed: tuple[torch.Tensor, ...] | None = None  # as Linear's

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        if self.tp.world_size == 1:
            return _linear(x, self.weight, self.bias, self.packed, gated)
        y = self.tp.all_reduce(_linear(x, self.weight, None, self.packed, gated))  # (T, out)
        return y if self.bias is None else y + self.bias


class Attention(nn.Module):
    """This rank's heads: nh / N query heads and nkv / N KV heads (whole GQA groups stay together)."""

    def __init__(self, c, tp: TPGroup):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_heads // tp.world_size, c.num_kv_heads // tp.world_size, c.head_dim
        self.qkv_proj = Linear(c.hidden_size, (self.nh + 2 * self.nkv) * self.hd, bias=c.qkv_bias)
        self.o_proj = RowParallelLinear(self.nh * self.hd, c.hidden_size, c.o_bias, tp)
        # Qwen3: each query and key head RMS-normed before RoPE (its weight's entries in the rows' interleaved order)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps) if c.qk_norm else None

    def forward(self, x, cis, kv_cache: torch.Tensor, meta: BatchMeta, norm: RMSNorm | None = None) -> torch.Tensor:
        """norm (DecoderLayer.folded): x is the residual stream, normed in q/k/v's GEMM, and o_proj's GEMM adds its
        output into x (returned)."""
        T = x.shape[0]
        shape = (T, self.nh + 2 * self.nkv, self.hd)
        written = True  # one kernel (one op on CPU) rotates and writes the new keys and values into the cache
        rope_in_gemm = self.q_norm is None and triton_gemm.fuse_rope  # the q/k norms come between the GEMM and RoPE
        if norm is not None or triton_fused.on(x) and rope_in_gemm and triton_gemm.on(x, self.qkv_proj.weight):
            rope = RopeKV(cis, kv_cache, meta.slot_mapping, self.nh, self.nkv)  # in the GEMM's finish
            fold = Fold(None if norm is None else (norm.weight, norm.eps), rope=rope)
            qkv = triton_gemm.linear(x, self.qkv_proj.weight, self.qkv_proj.bias, fold).view(shape)
        else:
            qkv = self.qkv_proj(x).view(shape)
            if self.q_norm is not None:
                q, k = qkv[:, : self.nh], qkv[:, self.nh : self.nh + self.nkv]
                q.copy_(torch.rms_norm(q, (self.hd,), self.q_norm.weight, self.q_norm.eps))
                k.copy_(torch.rms_norm(k, (self.hd,), self.k_norm.weight, self.k_norm.eps))
            if triton_fused.on(qkv):
                triton_fused.rope_kv_write_(qkv, cis, kv_cache, meta.slot_mapping)
            elif cpu_kernels.on(qkv):
                cpu_kernels.rope_(qkv, cis, kv_cache, meta.slot_mapping)
            else:
                Rotary.apply_(qkv, cis)
                written = False
        out = paged_attention(qkv[:, : self.nh], qkv[:, self.nh :], kv_cache, meta, 1.0, written=written)  # (T, nh, hd)
        if norm is not None:
            return triton_gemm.linear(out.reshape(T, -1), self.o_proj.weight, self.o_proj.bias, Fold(add_to=x))
        return self.o_proj(out.reshape(T, self.nh * self.hd))  # (T, D)


class MLP(nn.Module):
    def __init__(self, c, tp: TPGroup):
        super().__init__()
        self.inter = c.intermediate_size // tp.world_size  # this rank's share of the MLP
        self.gate_up_proj = Linear(c.hidden_size, 2 * self.inter, bias=c.mlp_bias)
        self.down_proj = RowParallelLinear(self.inter, c.hidden_size, c.mlp_bias, tp)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        """norm (DecoderLayer.folded): x is the residual stream, normed in gate_up's GEMM, and down_proj's GEMM adds
        its output into x (returned)."""
        if norm is not None:
            gate_up = triton_gemm.linear(
                x, self.gate_up_proj.weight, self.gate_up_proj.bias, Fold((norm.weight, norm.eps))
            )
            down = self.down_proj
            return triton_gemm.linear(gate_up, down.weight, down.bias, Fold(gated=True, add_to=x))
        gate_up = self.gate_up_proj(x)  # (T, 2I)
        if triton_fused.on(gate_up):  # SiLU-mul in down_proj's GEMM (triton_gemm), else a kernel of its own
            return self.down_proj(gate_up, gated=True)
        if cpu_kernels.on(gate_up):
            return self.down_proj(cpu_kernels.silu_mul(gate_up))
        return self.down_proj(F.silu(gate_up[:, : self.inter]).mul_(gate_up[:, self.inter :]))


class DecoderLayer(nn.Module):
    def __init__(self, c, tp: TPGroup):
        super().__init__()
        self.self_attn = Attention(c, tp)
        self.mlp = MLP(c, tp)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, delta, cis, kv_cache, meta: BatchMeta) -> torch.Tensor | None:
        """x (T, D) is the residual stream, summed in place (a fresh tensor of the forward); `delta` is the previous
        layer's MLP output, not yet added (None before the first layer). Returns this layer's MLP output, or None
        where the GEMMs added it (folded)."""
        if delta is None and self.folded(x):
            self.self_attn(x, cis, kv_cache, meta, self.input_layernorm)
            self.mlp(x, self.post_attention_layernorm)
            return None
        attn = self.self_attn(self.input_layernorm(x, delta), cis, kv_cache, meta)
        return self.mlp(self.post_attention_layernorm(x, attn))

    def folded(self, x: torch.Tensor) -> bool:
        """Whether the norms and residual adds go into the GEMMs (triton_gemm's folds, with RoPE and SiLU-mul): a
        decode step's few rows on cuda, one rank (a row-parallel GEMM's output is summed across ranks first)."""
        g = triton_gemm  # NOTE: triton_fused.on first: on CPU it is the whole cost of this check
        return (
            triton_fused.on(x)
            and self.self_attn.q_norm is None  # the q/k norms between the GEMM and RoPE: not foldable
            and g.fuse_norm
            and g.fuse_rope
            and g.fuse_silu
            and self.mlp.down_proj.tp.world_size == 1
            and g.on(x, self.self_attn.qkv_proj.weight)
        )


__all__ = [
    "Attention",
    "DecoderLayer",
    "MLP",
    "RMSNorm",
    "Rotary",
    "RowParallelLinear",
    "interleave_rope_rows",
    "pack_linears",
]
