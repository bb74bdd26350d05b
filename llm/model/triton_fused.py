"""The decoder layer's small ops as one Triton kernel each, for cuda: residual add + RMSNorm, RoPE + the KV write,
SiLU-mul. A decode step of the 2B-shaped model on an H200 ran ~18 kernels per layer with torch's ops (BENCHMARKS.md,
GPU): four GEMMs, and ~14 small kernels of ~2-3 us each, almost half of the step's GPU time. These made it 10 (four
GEMMs, these three, the attention's two), with the same math and rounding as the torch path they replace; 5 where
they fold into triton_gemm's GEMMs (llm/model/gemm_kernel.py) and the attention's combine into its split kernel:

- `add_rms_norm`: x += delta, rounded to x's dtype and written back (the residual stream), then RMSNorm of that in
  float32, rounded to the dtype before the weight multiplies (as transformers' Qwen2RMSNorm does).
- `rope_kv_write_`: the q and k heads of qkv rotated in place (the complex multiply of layers.Rotary in float32,
  rounded once), and the rotated keys and the values written into the cache at each token's slot.
- `silu_mul`: SiLU of the gate, rounded to the dtype, times up, rounded (F.silu(g).mul_(u) of the torch path).

Arithmetic in float32 on upcast loads (Triton's interpreter, which the CPU tests run them in, cannot compute in
bfloat16). No host sync and shapes from the inputs alone, so CUDA graphs capture them. The torch path stays for CPU
(llm/model/cpu_kernels.py there), for torch.compile (Inductor fuses its own) and where triton is missing.
(One kernel per fused elementwise group as vLLM's and nano-vllm's fused add-RMSNorm, SiLU-and-mul and RoPE ops; ours.)
"""

from __future__ import annotations

import torch

from llm.model import pdl
from llm.model.triton_attention import _INTERPRETED, _next_power_of_2, triton

if triton is not None:
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Whether the layers use these kernels where they can run; bench/gpu_decode.py turns it off to time torch's ops.
enabled = True


def on(x: torch.Tensor) -> bool:
    """Whether x's small ops go to these kernels: on cuda (on CPU only in Triton's interpreter, the tests), not while
    torch.compile traces."""
    return (x.is_cuda or _INTERPRETED) and enabled and triton is not None and not torch.compiler.is_compiling()


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, delta_ptr, w_ptr, out_ptr, D, eps, stride_x, stride_d, stride_o,
        HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # llm/model/pdl.py: nothing is read or written before the kernel before this one is done
            gdc_wait()
            gdc_launch_dependents()
        t = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        is_col = cols < D
        x = tl.load(x_ptr + t * stride_x + cols, mask=is_col, other=0.0).to(tl.float32)
        if HAS_DELTA:
            d = tl.load(delta_ptr + t * stride_d + cols, mask=is_col, other=0.0).to(tl.float32)
            x_low = (x + d).to(x_ptr.dtype.element_ty)  # the residual stream keeps its dtype: round first
            tl.store(x_ptr + t * stride_x + cols, x_low, mask=is_col)
            x = x_low.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
        w = tl.load(w_ptr + cols, mask=is_col, other=0.0).to(tl.float32)
        y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(out_ptr + t * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=is_col)

    @triton.jit
    def _rope_kv_kernel(
        qkv_ptr, cis_ptr, cache_ptr, slots_ptr, stride_qt, stride_qh, stride_ct, stride_ch, stride_cache_h,
        NH: tl.constexpr, NKV: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        t, h = tl.program_id(0), tl.program_id(1)  # a token, one of its nh + 2 nkv heads
        i = tl.arange(0, HALF_P2)
        is_pair = i < HALF
        head = qkv_ptr + t * stride_qt + h * stride_qh
        even = tl.load(head + 2 * i, mask=is_pair, other=0.0).to(tl.float32)
        odd = tl.load(head + 2 * i + 1, mask=is_pair, other=0.0).to(tl.float32)
        if h < NH + NKV:  # a query or key head: rotate in place
            rot = cis_ptr + t * stride_ct + h * stride_ch
            c = tl.load(rot + 2 * i, mask=is_pair, other=0.0)
            s = tl.load(rot + 2 * i + 1, mask=is_pair, other=0.0)
            even, odd = even * c - odd * s, even * s + odd * c
            tl.store(head + 2 * i, even.to(qkv_ptr.dtype.element_ty), mask=is_pair)
            tl.store(head + 2 * i + 1, odd.to(qkv_ptr.dtype.element_ty), mask=is_pair)
        if h >= NH:  # a key or value head: into the cache, (2 nkv, num_blocks * block_size, hd) at the token's slot
            slot = tl.load(slots_ptr + t).to(tl.int64)
            dst = cache_ptr + (h - NH) * stride_cache_h + slot * (2 * HALF)
            tl.store(dst + 2 * i, even.to(cache_ptr.dtype.element_ty), mask=is_pair)
            tl.store(dst + 2 * i + 1, odd.to(cache_ptr.dtype.element_ty), mask=is_pair)

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, inter, stride_g, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        is_col = cols < inter
        g = tl.load(gate_up_ptr + t * stride_g + cols, mask=is_col, other=0.0).to(tl.float32)
        u = tl.load(gate_up_ptr + t * stride_g + inter + cols, mask=is_col, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + t * stride_o + cols, (act * u).to(out_ptr.dtype.element_ty), mask=is_col)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (T, D) += delta (in place, if given); returns RMSNorm(x) * weight, (T, D) in x's dtype."""
    T, D = x.shape
    assert x.stride(1) == 1 and (delta is None or delta.stride(1) == 1), "rows must be contiguous"
    out = torch.empty_like(x)
    if T:
        _add_rms_norm_kernel[(T,)](
            x, x if delta is None else delta, weight, out, D, eps, x.stride(0), 0 if delta is None else delta.stride(0),
            out.stride(0), HAS_DELTA=delta is not None, BLOCK=_next_power_of_2(D), num_warps=4 if D <= 4096 else 8,
            **pdl.kwargs(x.device),
        )  # fmt: skip
    return out


def rope_kv_write_(qkv: torch.Tensor, cis: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """qkv (T, nh + 2 nkv, hd), rows contiguous per head: its q and k heads rotated in place by cis (T, nh + nkv,
    hd/2, 2) float32, then the keys and values written to kv_cache (2 nkv, num_blocks, block_size, hd) at the flat
    slots (T,)."""
    T, H, hd = qkv.shape
    n, two_nkv = cis.shape[1], kv_cache.shape[0]
    assert H == n + two_nkv // 2 and kv_cache.shape[-1] == hd and hd % 2 == 0, (qkv.shape, cis.shape, kv_cache.shape)
    assert qkv.stride(2) == 1 and cis.stride(3) == 1 and cis.stride(2) == 2, "pairs must be adjacent"
    assert kv_cache.stride(2) == hd and kv_cache.stride(1) == kv_cache.shape[2] * hd, "cache heads must be contiguous"
    if T:
        _rope_kv_kernel[(T, H)](
            qkv, cis, kv_cache, slots, qkv.stride(0), qkv.stride(1), cis.stride(0), cis.stride(1), kv_cache.stride(0),
            NH=H - two_nkv, NKV=two_nkv // 2, HALF=hd // 2, HALF_P2=_next_power_of_2(hd // 2), num_warps=1,
            **pdl.kwargs(qkv.device),
        )  # fmt: skip


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I): gate then up -> SiLU(gate) * up, (T, I)."""
    T, two_i = gate_up.shape
    assert gate_up.stride(1) == 1
    inter, block = two_i // 2, 1024
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        _silu_mul_kernel[(T, -(-inter // block))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4, **pdl.kwargs(out.device)
        )
    return out


__all__ = ["add_rms_norm", "on", "rope_kv_write_", "silu_mul"]
