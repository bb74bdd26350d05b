"""The decode step's GEMMs of few rows (at most 16) on cuda: a Triton kernel where it measures faster than cuBLAS.

At batch 1-16 a decode step's linears are matrix-vector products that stream the weight once; cuBLAS's kernels for
them reached 0.75-1.2 TB/s on the 2B-shaped model's q/k/v and o projections on an H200 (of ~4 TB/s: a few CTAs for
a 2048-row weight), 2.3 TB/s on down_proj (split-K plus a reduce kernel) and 3.1 on gate_up (BENCHMARKS.md, GPU).

The kernel: a program per BLOCK_N output columns and per K split; the rows padded to 16 (the smallest `tl.dot` tile)
by masked loads; the weight streamed in (BLOCK_N, BLOCK_K) tiles, a float32 accumulator. With SPLIT_K > 1 each
program writes its partial sum to a float32 workspace and the last of a column block's programs to arrive (an atomic
counter, reset by that program, so a CUDA graph replays it) sums them, adds the bias and writes the output: one kernel
where cuBLAS's split-K takes two. (Split-K with a semaphore and in-kernel fix-up as in CUTLASS's and stream-K's GEMMs.)

Two of triton_fused's kernels (~2 us each a layer in a graph) fold into these GEMMs, with their roundings:
- `gated`: down_proj takes gate_up_proj's output, (gate, up), and each program computes SiLU(gate) * up on the tile
  it loads;
- `rope`: q/k/v's epilogue (the program that holds a tile's whole sums: with SPLIT_K > 1, the last to arrive)
  rounds the projection, rotates its q and k pairs (adjacent: layers.py) and writes its keys and values into the
  paged cache at the tokens' slots.
(An activation in the GEMM's prologue and RoPE in its epilogue, as vLLM's fused-MoE and CUTLASS's epilogue-visitor
GEMMs fuse theirs; ours.)

Which runs is measured, not guessed: at the first call for a weight shape (N, K), dtype and fold, each config
below that agrees with `F.linear` on that call's input, and `F.linear` itself (with the kernels it folds), run 20 times
inside a CUDA graph (what a decode step replays); the fastest is kept for the process and logged. Never during a
graph capture (that call uses F.linear and decides nothing), never for float32 (cuBLAS keeps the reference
numerics), never under torch.compile.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F

from llm.model import pdl, triton_fused
from llm.model.triton_attention import _INTERPRETED, triton

if triton is not None:
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

logger = logging.getLogger(__name__)

MAX_ROWS = 16
enabled = True  # bench/gpu_decode.py turns it off to time cuBLAS alone
# The folds of 2026-12-05 (bench/gpu_decode.py's "prefold" turns them off, to time the step before them): an MLP's
# SiLU-mul in down_proj's loads, and RoPE + the KV write in q/k/v's epilogue, where each was a kernel of its own.
fuse_silu = fuse_rope = True
# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)
CONFIGS = ((16, 256, 1, 4, 4), (32, 256, 1, 4, 4), (64, 128, 1, 4, 4), (16, 512, 1, 4, 3), (16, 256, 2, 4, 4),
           (16, 256, 4, 4, 4), (32, 256, 4, 4, 4), (16, 256, 8, 4, 4))  # fmt: skip
_choice: dict[tuple[int, int, torch.dtype, bool, bool], tuple[int, ...] | None] = {}  # None: cuBLAS
_counters: dict[torch.device, torch.Tensor] = {}  # per device, never reallocated (captured graphs hold them)
_COUNTERS = 1 << 15  # column blocks at most: 524k output columns at BLOCK_N 16


def on(x: torch.Tensor, weight: torch.Tensor, gated: bool = False, rope: bool = False) -> bool:
    """Whether this linear may use the kernel: 16-bit, at most 16 rows, on cuda (on CPU in Triton's interpreter);
    gated: x is an MLP's (gate, up), twice the weight's width, for SiLU(gate) * up times the weight; rope: q/k/v
    with RoPE and the KV write in the epilogue."""
    return (
        (x.is_cuda or _INTERPRETED)  # first: on CPU this is the whole cost of a linear's check
        and enabled
        and triton is not None
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.stride(1) == weight.stride(1) == 1
        and -(-weight.shape[0] // 16) <= _COUNTERS
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and not torch.compiler.is_compiling()
        and (not gated or (fuse_silu and x.shape[1] == 2 * weight.shape[1]))
        and (not rope or fuse_rope)
    )


if triton is not None:

    @triton.jit
    def _small_gemm_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, cis_ptr, cache_ptr, slots_ptr, M, N, K, stride_xm, stride_wn,
        stride_ym, stride_ct, stride_cache_h, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr, UPCAST: tl.constexpr, GATED: tl.constexpr, ROPE_NH: tl.constexpr, ROPE_NKV: tl.constexpr,
        HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # llm/model/pdl.py: nothing is read or written before the kernel before this one is done
            gdc_wait()
        n_block, split = tl.program_id(0), tl.program_id(1)
        cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, 16)
        is_col, is_row = cols < N, rows < M
        k_len = ((K + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K  # whole tiles per split
        k_start = split * k_len
        k_end = tl.minimum(k_start + k_len, K)
        acc = tl.full([16, BLOCK_N], 0.0, tl.float32)
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
            w = tl.load(
                w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=is_col[:, None] & is_k[None, :], other=0.0
            )
            if UPCAST:  # the interpreter cannot multiply 16-bit floats
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(x, tl.trans(w))  # (16, BLOCK_N)
        if PDL:  # the next kernel may start its launch now (it waits for this one's end before any memory access)
            gdc_launch_dependents()
        if SPLIT_K == 1:
            _finish(acc, b_ptr, y_ptr, rows, cols, is_row, is_col, stride_ym, HAS_BIAS, cis_ptr, cache_ptr, slots_ptr,
                    stride_ct, stride_cache_h, ROPE_NH, ROPE_NKV, HEAD_DIM, BLOCK_N)  # fmt: skip
        else:
            part = part_ptr + (split * 16 + rows[:, None]) * N + cols[None, :]
            tl.store(part, acc, mask=is_col[None, :])
            tl.debug_barrier()  # every thread's partial stored before the one atomic below releases them
            arrived = tl.atomic_add(count_ptr + n_block, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # the last program of this column block: sum the splits
                acc = tl.full([16, BLOCK_N], 0.0, tl.float32)
                for s in range(SPLIT_K):
                    part = part_ptr + (s * 16 + rows[:, None]) * N + cols[None, :]
                    acc += tl.load(part, mask=is_col[None, :], other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(count_ptr + n_block, 0)  # ready for the next launch (or graph replay)
                _finish(acc, b_ptr, y_ptr, rows, cols, is_row, is_col, stride_ym, HAS_BIAS, cis_ptr, cache_ptr,
                        slots_ptr, stride_ct, stride_cache_h, ROPE_NH, ROPE_NKV, HEAD_DIM, BLOCK_N)  # fmt: skip

    @triton.jit
    def _finish(
        acc, b_ptr, y_ptr, rows, cols, is_row, is_col, stride_ym, HAS_BIAS: tl.constexpr, cis_ptr, cache_ptr, slots_ptr,
        stride_ct, stride_cache_h, ROPE_NH: tl.constexpr, ROPE_NKV: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=is_col, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + rows[:, None] * stride_ym + cols[None, :]
        is_y = is_row[:, None] & is_col[None, :]
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


class RopeKV(NamedTuple):
    """What triton_fused.rope_kv_write_ takes besides q/k/v: the GEMM's epilogue rotates and writes the cache."""

    cis: torch.Tensor  # (T, nh + nkv, hd / 2, 2) float32
    cache: torch.Tensor  # (2 nkv, num_blocks, block_size, hd)
    slots: torch.Tensor  # (T,)
    nh: int
    nkv: int


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: tuple[int, ...],
            gated: bool = False, rope: RopeKV | None = None) -> torch.Tensor:  # fmt: skip
    block_n, block_k, split_k, warps, stages = config
    (M, _), (N, K) = x.shape, weight.shape
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    n_blocks = -(-N // block_n)
    part = torch.empty(split_k * 16, N, dtype=torch.float32, device=x.device) if split_k > 1 else y
    counters = _counters.get(x.device)
    if counters is None:  # zeros; each launch leaves them zero
        counters = _counters[x.device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=x.device)
    cis, cache, slots, nh, nkv = rope or (weight, weight, weight, 0, 0)
    hd = cache.shape[-1] if rope else 2
    if rope:
        assert N == (nh + 2 * nkv) * hd and cis.shape[1:] == (nh + nkv, hd // 2, 2) and cis.is_contiguous(), cis.shape
        assert cache.stride(2) == hd and cache.stride(1) == cache.shape[2] * hd, "cache heads must be contiguous"
    _small_gemm_kernel[(n_blocks, split_k)](
        x, weight, weight if bias is None else bias, y, part, counters, cis, cache, slots, M, N, K, x.stride(0),
        weight.stride(0), y.stride(0), cis.stride(0), cache.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split_k, UPCAST=_INTERPRETED, GATED=gated, ROPE_NH=nh, ROPE_NKV=nkv, HEAD_DIM=hd,
        num_warps=warps, num_stages=stages, **pdl.kwargs(x.device),
    )  # fmt: skip
    return y


def _without(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool, rope: RopeKV | None):
    """What the step runs without this kernel: triton_fused's SiLU-mul, cuBLAS, triton_fused's RoPE + KV write."""
    y = F.linear(triton_fused.silu_mul(x) if gated else x, weight, bias)
    if rope:
        triton_fused.rope_kv_write_(y.view(len(y), rope.nh + 2 * rope.nkv, -1), *rope[:3])
    return y


def _graph_us(fn, reps: int = 20) -> float:
    """Microseconds per call of fn, replayed as a CUDA graph of `reps` calls (no host launch cost in it)."""
    fn()  # compile, allocate
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads' CUDA calls stay legal
        for _ in range(reps):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    best = float("inf")
    for _ in range(3):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / reps)
    return best


def _choose(x, weight, bias, gated: bool, rope: RopeKV | None) -> tuple[int, ...] | None:
    try:
        times = {None: _graph_us(lambda: _without(x, weight, bias, gated, rope))}
    except Exception as e:  # noqa: BLE001 (no timing, no choice: cuBLAS, as without this module)
        logger.warning("linear of %d x %d stays on cuBLAS: timing it failed: %s", *weight.shape, e)
        return None
    want = _without(x, weight, bias, gated, rope).float()
    for config in CONFIGS:
        try:
            ours = _launch(x, weight, bias, config, gated, rope).float()
            error = float((ours - want).norm() / want.norm().clamp_min(1e-30))
            if not error < 1e-2:  # a bfloat16 rounding is 4e-3 at most: anything more is a fault, never chosen
                raise ValueError(f"relative error {error:.2e} against F.linear")
            times[config] = _graph_us(lambda c=config: _launch(x, weight, bias, c, gated, rope))
        except Exception as e:  # noqa: BLE001 (a config that does not compile, fit or agree is left out)
            logger.warning("small GEMM config %s left out for (%d, %d): %s", config, *weight.shape, e)
    best = min(times, key=times.get)
    logger.info(
        "linear %s of %d x %d%s at %d rows: cuBLAS %.1f us, ours %.1f us (%s): %s", weight.dtype, *weight.shape,
        " after SiLU-mul" if gated else " with RoPE + KV write" if rope else "", x.shape[0], times[None],
        min(v for c, v in times.items() if c) if len(times) > 1 else float("nan"), best, "ours" if best else "cuBLAS",
    )  # fmt: skip
    return best  # (the timing runs wrote the cache too, the same keys and values; the chosen path writes it last)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False, rope: RopeKV | None = None
) -> torch.Tensor:
    """F.linear(x (M, K), weight (N, K), bias) for M <= 16, by the kernel or cuBLAS, whichever measured faster.
    gated: x is (M, 2K), (gate, up), and the product is of SiLU(gate) * up: in the kernel's loads (one kernel), or
    triton_fused.silu_mul then cuBLAS (two). rope: the output is q/k/v, rotated and its keys and values written to
    the cache as triton_fused.rope_kv_write_ does: in the kernel's epilogue, or that kernel after cuBLAS."""
    if _INTERPRETED and x.device.type == "cpu":
        return _launch(x, weight, bias, CONFIGS[0], gated, rope)
    key = (*weight.shape, weight.dtype, gated, rope is not None)
    if key not in _choice:
        if torch.cuda.is_current_stream_capturing():
            return _without(x, weight, bias, gated, rope)
        _choice[key] = _choose(x, weight, bias, gated, rope)
    config = _choice[key]
    return _without(x, weight, bias, gated, rope) if config is None else _launch(x, weight, bias, config, gated, rope)


__all__ = ["CONFIGS", "MAX_ROWS", "RopeKV", "linear", "on"]
