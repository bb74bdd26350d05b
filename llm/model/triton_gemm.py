"""The decode step's GEMMs of few rows (at most 16) on cuda: llm/model/gemm_kernel.py's Triton kernel, with the
layer's small ops folded in, where it measures faster than cuBLAS and those ops' own kernels.

At batch 1-16 a decode step's linears are matrix-vector products that stream the weight once; cuBLAS's kernels for
them reached 0.75-1.2 TB/s on the 2B-shaped model's q/k/v and o projections on an H200 (of ~4 TB/s: a few CTAs for
a 2048-row weight), 2.3 TB/s on down_proj (split-K plus a reduce kernel) and 3.1 on gate_up (BENCHMARKS.md, GPU).

Which runs is measured, not guessed: at the first call for a weight shape (N, K), dtype and fold, each config of
gemm_kernel.CONFIGS that agrees with the path without it on that call's input, and that path itself (triton_fused's
kernels for the folded ops, cuBLAS for the product), run 20 times inside a CUDA graph (what a decode step replays);
the fastest is kept for the process and logged. Never during a graph capture (that call takes the path without the
kernel and decides nothing), never for float32 (cuBLAS keeps the reference numerics), never under torch.compile.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F

from llm.model import gemm_kernel, triton_fused
from llm.model.gemm_kernel import CONFIGS, NO_FOLD, Fold, RopeKV
from llm.model.triton_attention import _COUNTERS, _INTERPRETED, triton

logger = logging.getLogger(__name__)

MAX_ROWS = 16
enabled = True  # bench/gpu_decode.py turns it off to time cuBLAS alone
# The folds of 2026-12-05, each where a kernel of its own ran (bench/gpu_decode.py's "prefold" turns them off to time
# the step before them): RMSNorm in q/k/v's and gate_up's loads and the residual add in o_proj's and down_proj's
# finish (fuse_norm, together: the norm reads what the add summed), the MLP's SiLU-mul in down_proj's loads, RoPE and
# the KV write in q/k/v's finish.
fuse_norm = fuse_silu = fuse_rope = True
_choice: dict[tuple, tuple[int, ...] | None] = {}  # (N, K, dtype, fold) -> a config, None: cuBLAS


def on(x: torch.Tensor, weight: torch.Tensor, fold: Fold = NO_FOLD) -> bool:
    """Whether this linear may use the kernel: 16-bit, at most 16 rows, on cuda (on CPU in Triton's interpreter),
    with the folds that are on (gated: x twice the weight's width)."""
    return (
        (x.is_cuda or _INTERPRETED)  # first: on CPU this is the whole cost of a linear's check
        and enabled
        and triton is not None
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.stride(1) == weight.stride(1) == 1
        and -(-weight.shape[0] // 16) <= _COUNTERS  # a counter per column block
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and not torch.compiler.is_compiling()
        and (not fold.gated or (fuse_silu and x.shape[1] == 2 * weight.shape[1]))
        and (fold.rope is None or fuse_rope)
        and (fold.norm is None and fold.add_to is None or fuse_norm)
    )


def without(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fold: Fold = NO_FOLD) -> torch.Tensor:
    """The same as the kernel with `fold`, by triton_fused's kernels and cuBLAS (the kernel-free path)."""
    if fold.norm is not None:
        x = triton_fused.add_rms_norm(x, None, *fold.norm)
    y = F.linear(triton_fused.silu_mul(x) if fold.gated else x, weight, bias)
    if fold.rope:
        triton_fused.rope_kv_write_(y.view(len(y), fold.rope.nh + 2 * fold.rope.nkv, -1), *fold.rope[:3])
    return y if fold.add_to is None else fold.add_to.add_(y)


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


def _choose(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fold: Fold) -> tuple[int, ...] | None:
    # NOTE: the timing runs add into a copy of the residual stream (adding is not idempotent), and write the cache
    # (RoPE) with the same keys and values each time: the chosen path writes them last, after this.
    def run(config: tuple[int, ...] | None, scratch: torch.Tensor | None) -> torch.Tensor:
        f = dataclasses.replace(fold, add_to=scratch)
        return without(x, weight, bias, f) if config is None else gemm_kernel.launch(x, weight, bias, config, f)

    residual = None if fold.add_to is None else fold.add_to.clone()
    scratch = None if residual is None else residual.clone()
    try:
        times = {None: _graph_us(lambda: run(None, scratch))}
    except Exception as e:  # noqa: BLE001 (no timing, no choice: cuBLAS, as without this module)
        logger.warning("linear of %d x %d stays on cuBLAS: timing it failed: %s", *weight.shape, e)
        return None
    fresh = lambda: None if residual is None else residual.clone()  # noqa: E731
    want = run(None, fresh()).float()
    for config in CONFIGS:
        try:
            error = float((run(config, fresh()).float() - want).norm() / want.norm().clamp_min(1e-30))
            if not error < 1e-2:  # a bfloat16 rounding is 4e-3 at most: anything more is a fault, never chosen
                raise ValueError(f"relative error {error:.2e} against the path without the kernel")
            times[config] = _graph_us(lambda c=config: run(c, scratch))
        except Exception as e:  # noqa: BLE001 (a config that does not compile, fit or agree is left out)
            logger.warning("small GEMM config %s left out for (%d, %d): %s", config, *weight.shape, e)
    best = min(times, key=times.get)
    folds = "+".join(n for n, on in zip(("norm", "SiLU-mul", "RoPE/KV", "residual"), fold.key(), strict=True) if on)
    logger.info(
        "linear %s of %d x %d (%s) at %d rows: cuBLAS %.1f us, ours %.1f us (%s): %s", weight.dtype, *weight.shape,
        folds or "alone", x.shape[0], times[None], min(v for c, v in times.items() if c) if len(times) > 1
        else float("nan"), best, "ours" if best else "cuBLAS",
    )  # fmt: skip
    return best


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fold: Fold = NO_FOLD) -> torch.Tensor:
    """F.linear(x (M, K), weight (N, K), bias) for M <= 16 with `fold`'s ops (gemm_kernel.py), by the kernel or by
    the path without it, whichever measured faster; the product, or fold.add_to with the product summed into it."""
    if _INTERPRETED and x.device.type == "cpu":
        return gemm_kernel.launch(x, weight, bias, CONFIGS[0], fold)
    key = (*weight.shape, weight.dtype, fold.key())
    if key not in _choice:
        if torch.cuda.is_current_stream_capturing():
            return without(x, weight, bias, fold)
        _choice[key] = _choose(x, weight, bias, fold)
    config = _choice[key]
    return without(x, weight, bias, fold) if config is None else gemm_kernel.launch(x, weight, bias, config, fold)


__all__ = ["MAX_ROWS", "Fold", "RopeKV", "linear", "on", "without"]
