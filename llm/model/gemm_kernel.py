"""The few-row GEMM kernel of llm/model/triton_gemm.py (which decides where it runs), with the decoder layer's small
ops folded into it.

A program per BLOCK_N output columns and per K split; the rows padded to 16 (the smallest `tl.dot` tile) by masked
loads; the weight streamed in (BLOCK_N, BLOCK_K) tiles, a float32 accumulator. With SPLIT_K > 1 each program writes
its partial sum to a float32 workspace and the last of a column block's programs to arrive (an atomic counter, reset
by that program, so a CUDA graph replays it) sums them and finishes: one kernel where cuBLAS's split-K takes two.
(Split-K with a semaphore and in-kernel fix-up as in CUTLASS's and stream-K's GEMMs.)

The layer's small ops fold in (`Fold`), each a kernel of ~2 us in a graph where it ran alone (BENCHMARKS.md, GPU):
- `norm`: x is the residual stream and the GEMM's input its RMSNorm: each program multiplies its tiles by the norm's
  weight and sums their squares, and the finish divides by the row's rms (q/k/v, gate_up);
- `gated`: x is gate_up_proj's output, (gate, up), and the input SiLU(gate) * up, rounded as
  triton_fused.silu_mul rounds it (down_proj);
- `rope`: the finish rounds the projection, rotates its q and k pairs (adjacent: layers.py) and writes its keys and
  values into the paged cache at the tokens' slots, as triton_fused.rope_kv_write_ does (q/k/v);
- `add_to`: the finish adds the rounded projection into the residual stream, in place (o_proj, down_proj).
With norm the rounding differs from RMSNorm then the GEMM (the norm's output is not rounded to 16 bits before its
1 / rms): bfloat16 only, where the float32 reference is not matched bit for bit anyway. (An activation in the GEMM's
prologue and RoPE or a residual in its epilogue, as vLLM's fused-MoE and CUTLASS's epilogue-visitor GEMMs fuse
theirs; ours.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from llm.model import pdl
from llm.model.triton_attention import _INTERPRETED, arrival_counters, triton

if triton is not None:
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)
CONFIGS = ((16, 256, 1, 4, 4), (32, 256, 1, 4, 4), (64, 128, 1, 4, 4), (16, 512, 1, 4, 3), (16, 256, 2, 4, 4),
           (16, 256, 4, 4, 4), (32, 256, 4, 4, 4), (16, 256, 8, 4, 4))  # fmt: skip


class RopeKV(NamedTuple):
    """What triton_fused.rope_kv_write_ takes besides q/k/v."""

    cis: torch.Tensor  # (T, nh + nkv, hd / 2, 2) float32
    cache: torch.Tensor  # (2 nkv, num_blocks, block_size, hd)
    slots: torch.Tensor  # (T,)
    nh: int
    nkv: int


@dataclass(frozen=True)
class Fold:
    """The small ops a GEMM takes in (module docstring); none by default."""

    norm: tuple[torch.Tensor, float] | None = None  # RMSNorm's (weight, eps)
    gated: bool = False
    rope: RopeKV | None = None
    add_to: torch.Tensor | None = None  # the residual stream (M, N), summed in place and returned

    def key(self) -> tuple[bool, ...]:
        return self.norm is not None, self.gated, self.rope is not None, self.add_to is not None


NO_FOLD = Fold()

if triton is not None:

    @triton.jit
    def _small_gemm_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, ssq_ptr, count_ptr, norm_ptr, cis_ptr, cache_ptr, slots_ptr, M, N, K,
        stride_xm, stride_wn, stride_ym, stride_ct, stride_cache_h, eps, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, UPCAST: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
        ADD: tl.constexpr, ROPE_NH: tl.constexpr, ROPE_NKV: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
        PREFETCH: tl.constexpr,
    ):  # fmt: skip
        n_block, split = tl.program_id(0), tl.program_id(1)
        k_len = ((K + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K  # whole tiles per split
        k_start = split * k_len
        k_end = tl.minimum(k_start + k_len, K)
        if PREFETCH > 0:  # PDL: the first weight tiles into L2 while the kernel before ends (it writes no weight)
            row, start, n = _prefetch_span(n_block, k_start, k_end, N, BLOCK_N, PREFETCH)
            _prefetch_l2(
                w_ptr + row.to(tl.int64) * stride_wn + start, n * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
            )
        if PDL:  # llm/model/pdl.py: nothing is read or written before the kernel before this one is done
            gdc_wait()
        cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, 16)
        is_col, is_row = cols < N, rows < M
        acc = tl.full([16, BLOCK_N], 0.0, tl.float32)
        ssq = tl.full([16], 0.0, tl.float32)  # NORM: the rows' sums of squares over this split's columns
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            is_k = ks < k_end
            x_at, is_x = x_ptr + rows[:, None] * stride_xm + ks[None, :], is_row[:, None] & is_k[None, :]
            if GATED:  # x is (gate, up): SiLU(gate) * up, rounded as triton_fused.silu_mul rounds it
                g = tl.load(x_at, mask=is_x, other=0.0).to(tl.float32)
                u = tl.load(x_at + K, mask=is_x, other=0.0).to(tl.float32)
                act = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty).to(tl.float32)
                x = (act * u).to(x_ptr.dtype.element_ty)
            else:
                x = tl.load(x_at, mask=is_x, other=0.0)
            if NORM:  # x is the residual stream: RMSNorm's weight on the loads, its 1 / rms on the sums (_finish)
                xf = x.to(tl.float32)
                ssq += tl.sum(xf * xf, 1)
                x = (xf * tl.load(norm_ptr + ks, mask=is_k, other=0.0).to(tl.float32)[None, :]).to(x.dtype)
            w = tl.load(
                w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=is_col[:, None] & is_k[None, :], other=0.0
            )
            if UPCAST:  # the interpreter cannot multiply 16-bit floats
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(x, tl.trans(w))  # (16, BLOCK_N)
        if PDL:  # the next kernel may start its launch now (it waits for this one's end before any memory access)
            gdc_launch_dependents()
        if SPLIT_K == 1:
            _finish(acc, ssq, b_ptr, y_ptr, rows, cols, is_row, is_col, K, stride_ym, eps, HAS_BIAS, NORM, ADD, cis_ptr,
                    cache_ptr, slots_ptr, stride_ct, stride_cache_h, ROPE_NH, ROPE_NKV, HEAD_DIM, BLOCK_N)  # fmt: skip
        else:
            part = part_ptr + (split * 16 + rows[:, None]) * N + cols[None, :]
            tl.store(part, acc, mask=is_col[None, :])
            if NORM:
                tl.store(ssq_ptr + (split * 16 + rows) * tl.num_programs(0) + n_block, ssq)
            tl.debug_barrier()  # every thread's partial stored before the one atomic below releases them
            arrived = tl.atomic_add(count_ptr + n_block, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # the last program of this column block: sum the splits
                acc = tl.full([16, BLOCK_N], 0.0, tl.float32)
                ssq = tl.full([16], 0.0, tl.float32)
                for s in range(SPLIT_K):
                    part = part_ptr + (s * 16 + rows[:, None]) * N + cols[None, :]
                    acc += tl.load(part, mask=is_col[None, :], other=0.0, cache_modifier=".cg")
                    if NORM:
                        ssq += tl.load(ssq_ptr + (s * 16 + rows) * tl.num_programs(0) + n_block, cache_modifier=".cg")
                tl.atomic_xchg(count_ptr + n_block, 0)  # ready for the next launch (or graph replay)
                _finish(acc, ssq, b_ptr, y_ptr, rows, cols, is_row, is_col, K, stride_ym, eps, HAS_BIAS, NORM, ADD,
                        cis_ptr, cache_ptr, slots_ptr, stride_ct, stride_cache_h, ROPE_NH, ROPE_NKV, HEAD_DIM,
                        BLOCK_N)  # fmt: skip

    @triton.jit
    def _prefetch_span(n_block, k_start, k_end, N, BLOCK_N: tl.constexpr, SPAN: tl.constexpr):
        """PREFETCH's 128 pieces (one a thread at 4 warps) of a program's first SPAN weight columns in each of its rows:
        (row, first column, columns); every piece a multiple of 8 columns, none past the split or the last row."""
        tl.static_assert(128 % BLOCK_N == 0, "a program's rows share the 128 pieces evenly")
        i = tl.arange(0, 128)
        row = n_block * BLOCK_N + i % BLOCK_N
        end = tl.minimum(k_start + SPAN, k_end)
        step = ((end - k_start + 128 // BLOCK_N - 1) // (128 // BLOCK_N) + 7) // 8 * 8
        start = k_start + i // BLOCK_N * step
        return row, start, tl.where(row < N, tl.maximum(tl.minimum(step, end - start), 0), 0)

    @triton.jit
    def _prefetch_l2(ptrs, nbytes):
        """sm_90's cp.async.bulk.prefetch.L2: nbytes (a multiple of 16; 0, none) from each 16-byte-aligned pointer."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; } // $0",
            "=r,l,r", [ptrs, nbytes.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip

    @triton.jit
    def _finish(
        acc, ssq, b_ptr, y_ptr, rows, cols, is_row, is_col, K, stride_ym, eps, HAS_BIAS: tl.constexpr,
        NORM: tl.constexpr, ADD: tl.constexpr, cis_ptr, cache_ptr, slots_ptr, stride_ct, stride_cache_h,
        ROPE_NH: tl.constexpr, ROPE_NKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        if NORM:
            acc = acc / tl.sqrt(ssq / K + eps)[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=is_col, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + rows[:, None] * stride_ym + cols[None, :]
        is_y = is_row[:, None] & is_col[None, :]
        if ADD:  # y is the residual stream: the projection, rounded, added into it (rounded), as x.add_(linear(h))
            acc = acc.to(y_ptr.dtype.element_ty).to(tl.float32) + tl.load(y, mask=is_y, other=0.0).to(tl.float32)
        if ROPE_NH == 0:
            tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=is_y)
        else:  # q/k/v: triton_fused.rope_kv_write_ on the tile, with its roundings (layers.py: pairs are adjacent)
            acc = acc.to(y_ptr.dtype.element_ty).to(tl.float32)  # the projection's output, rounded
            even, odd = tl.split(tl.reshape(acc, (16, BLOCK_N // 2, 2)))  # (16, BLOCK_N / 2) each
            col, _ = tl.split(tl.reshape(cols, (BLOCK_N // 2, 2)))  # each pair's first column
            head, pair = col // HEAD_DIM, col % HEAD_DIM // 2
            is_rot = is_row[:, None] & (head < ROPE_NH + ROPE_NKV)[None, :]  # a query or key head
            rot = cis_ptr + rows[:, None] * stride_ct + (head * HEAD_DIM + 2 * pair)[None, :]  # cis (T, nh + nkv, hd)
            c = tl.load(rot, mask=is_rot, other=1.0)
            s = tl.load(rot + 1, mask=is_rot, other=0.0)
            even, odd = even * c - odd * s, even * s + odd * c  # a value head: c = 1, s = 0
            tl.store(y, tl.reshape(tl.join(even, odd), (16, BLOCK_N)).to(y_ptr.dtype.element_ty), mask=is_y)
            is_kv = is_row[:, None] & ((head >= ROPE_NH) & (col < (ROPE_NH + 2 * ROPE_NKV) * HEAD_DIM))[None, :]
            slot = tl.load(slots_ptr + rows, mask=is_row, other=0).to(tl.int64)
            at = (head - ROPE_NH) * stride_cache_h + col % HEAD_DIM  # (BLOCK_N / 2,): the head's cache, the pair
            dst = cache_ptr + slot[:, None] * HEAD_DIM + at[None, :]
            tl.store(dst, even.to(cache_ptr.dtype.element_ty), mask=is_kv)
            tl.store(dst + 1, odd.to(cache_ptr.dtype.element_ty), mask=is_kv)


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: tuple[int, ...],
           fold: Fold = NO_FOLD) -> torch.Tensor:  # fmt: skip
    """The kernel for x (M, K) (or (M, 2K), gated) and weight (N, K): the product (M, N), or fold.add_to summed."""
    block_n, block_k, split_k, warps, stages = config
    (M, _), (N, K) = x.shape, weight.shape
    y = torch.empty(M, N, dtype=x.dtype, device=x.device) if fold.add_to is None else fold.add_to
    assert y.shape == (M, N) and y.stride(1) == 1 and y.dtype == x.dtype, (y.shape, y.dtype)
    n_blocks = -(-N // block_n)
    part = torch.empty(split_k * 16, N, dtype=torch.float32, device=x.device) if split_k > 1 else y
    ssq = torch.empty(split_k * 16, n_blocks, dtype=torch.float32, device=x.device) if split_k > 1 else part
    counters = arrival_counters(x.device)  # one per column block
    cis, cache, slots, nh, nkv = fold.rope or (weight, weight, weight, 0, 0)
    hd = cache.shape[-1] if fold.rope else 2
    if fold.rope:
        assert N == (nh + 2 * nkv) * hd and cis.shape[1:] == (nh + nkv, hd // 2, 2) and cis.is_contiguous(), cis.shape
        assert cache.stride(2) == hd and cache.stride(1) == cache.shape[2] * hd, "cache heads must be contiguous"
    norm, eps = fold.norm or (weight, 0.0)
    launch_pdl = pdl.kwargs(x.device)
    # the pipeline's first tiles, where each piece of them is whole 16 bytes at a 16-byte boundary
    aligned = (
        K % 8 == 0 and weight.stride(0) % 8 == 0 and weight.data_ptr() % 16 == 0 and weight.element_size() in (2, 4)
    )
    prefetch = block_k * stages if launch_pdl["PDL"] and pdl.prefetch and aligned else 0
    _small_gemm_kernel[(n_blocks, split_k)](
        x, weight, weight if bias is None else bias, y, part, ssq, counters, norm, cis, cache, slots, M, N, K,
        x.stride(0), weight.stride(0), y.stride(0), cis.stride(0), cache.stride(0), eps, HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, UPCAST=_INTERPRETED, GATED=fold.gated,
        NORM=fold.norm is not None, ADD=fold.add_to is not None, ROPE_NH=nh, ROPE_NKV=nkv, HEAD_DIM=hd,
        num_warps=warps, num_stages=stages, PREFETCH=prefetch, **launch_pdl,
    )  # fmt: skip
    return y


__all__ = ["CONFIGS", "NO_FOLD", "Fold", "RopeKV", "launch"]
