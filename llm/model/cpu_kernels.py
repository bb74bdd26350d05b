"""The engine's CPU kernels (llm/model/cpu_kernels.cpp, cpu_attention.cpp), built at replica start: paged decode
attention that reads the KV blocks in place, and one-op versions of what torch runs as several small ops per layer:
the residual add fused into RMSNorm, RoPE with the KV write, and SiLU-mul (with an AVX2 exp: torch's vectorised exp
beat a plain C++ loop). Each rounds where the torch ops it replaces round (to the model's dtype between ops), so they
compute the same thing; tests hold both paths to transformers (BENCHMARKS.md has what each kernel bought). Linears run
on packed copies of their weights (`pack_chunks`): float32 on our GEMM's panels of 16 columns on AVX2 CPUs
(cpu_gemm.h, `panels_for`), on oneDNN's layout elsewhere; bfloat16 on oneDNN where the CPU computes in bfloat16
(AVX-512-BF16, AMX). Elsewhere a bfloat16 linear of a few rows (decode batches) goes to a kernel of ours: without them
ATen runs bfloat16 GEMMs in a scalar fallback; ours widens each weight to float32 in registers and feeds FMAs (AVX2
builds), its weight rows split over the caller's team or shared with the helper thread as the panels are.

Attention: the eager path (llm/model/attention.py) gathers every decode row's blocks into a contiguous copy, then runs
two batched matmuls. This kernel reads each key and value once, where it lies: one task per (sequence, KV head),
the KV head's keys loaded once for its whole GQA group of query heads; scores, a float32 softmax and the weighted
sum of values per task, nothing materialised but the scores. Keys past a row's context are never read. NOTE: the
kernels run on the calling thread (built without -fopenmp, so at::parallel_for is serial: a second OpenMP runtime
next to torch's libgomp is not worth it), without the GIL; once `use_helper(True)`, the attention's tasks, and the
column chunks of linears (`pack_chunks`, cpu_linear.cpp), are shared with a helper
thread that takes them while it runs, and the caller never waits for one it has not started (cpu_share.h: a core
the node leaves partly idle helps without a preempted thread stalling the step). The idea is
vLLM's and SGLang's CPU decode kernels (paged attention per sequence and head); the code is ours.

The kernels are compiled with torch's cpp_extension (ninja, the machine's C++ compiler, -O3 -march=native:
cpu_build.py) the first time a process asks for them; the build is cached under TORCH_EXTENSIONS_DIR, so later
processes load it in about a second. Where they cannot be built (no compiler), `load()` says why once and returns
None, and the layers keep torch's ops (and attention the gather).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch
import torch.nn.functional as F

from llm.model import cpu_build, hugepages

logger = logging.getLogger(__name__)

_lock = threading.Lock()
# Kernel calls so far: the dispatcher does not see these calls, so op counts (tests, `make bench-kernels`) add them.
calls = 0
_module: object | None = None
_tried = False
_helper = False


def load():
    """The compiled module, or None where it cannot be built (said once in the log)."""
    global _module, _tried
    with _lock:
        if not _tried:
            _tried = True
            t0 = time.monotonic()
            try:
                _module = cpu_build.build()
                logger.info("CPU kernels ready in %.1f s", time.monotonic() - t0)
            except Exception as e:  # no compiler, no ninja, no headers: torch's ops still work
                logger.warning("CPU kernels could not be built (%s); the layers use torch's ops", e)
    return _module


def available() -> bool:
    """Built in this process (by `load()`); never builds it."""
    return _module is not None


def on(x: torch.Tensor) -> bool:
    """Whether x's ops go to these kernels: on CPU, once built, and not while torch.compile traces (it cannot see
    into them: a compiled step uses torch's ops, which Inductor fuses itself)."""
    return _module is not None and x.device.type == "cpu" and not torch.compiler.is_compiling()


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (T, D) += delta (in place, if given); returns RMSNorm(x) * weight."""
    global calls
    calls += 1
    return _module.add_rms_norm(x, delta, weight, eps)


def rope_(
    qkv: torch.Tensor, cis: torch.Tensor, kv_cache: torch.Tensor | None = None, slots: torch.Tensor | None = None
) -> None:
    """Rotate the first cis.shape[1] heads of qkv (T, H, hd) in place; cis (T, n, hd/2, 2) float32 (cos, sin). With
    kv_cache (2 * nkv, num_blocks, block_size, hd) and slots (T,) int64, then write each row's keys (rotated) and
    values, its last 2 * nkv heads, into the cache at its slot (attention.write_kv's write, in the same op)."""
    global calls
    calls += 1
    _module.rope_(qkv, cis, kv_cache, slots)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) -> silu(gate) * up (T, I), rounded as F.silu(gate).mul_(up) rounds."""
    global calls
    calls += 1
    return _module.silu_mul(gate_up)


def paged_decode_cpu(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """q (B, nh, hd); kv_cache (2 * nkv, num_blocks, block_size, hd): keys then values; block_tables (B, W) int32;
    context_lens (B,) int32, keys per row (>= 1) -> (B, nh, hd). `load()` must have returned the module."""
    global calls
    calls += 1
    return _module.paged_decode(q, kv_cache, block_tables, context_lens, scale)


def use_helper(on: bool, delay_us: int = 0) -> None:
    """Share the decode attention's tasks (`paged_decode_cpu`) and the linears' column chunks (`linear` on
    `pack_chunks`) with the helper thread (started at the first True; it lives with the process), or stop sharing.
    `delay_us` (tests): the helper sleeps that long in each task it takes, as if preempted. `load()` must have
    returned the module."""
    global _helper
    _module.use_helper(on, delay_us)
    _helper = on


def helper_on() -> bool:
    """Whether `use_helper(True)` holds in this process."""
    return _helper


def helper_stats() -> tuple[int, int, int]:
    """(calls shared with the helper, tasks it computed, tasks it had started that the caller took over) so far."""
    return tuple(_module.helper_stats())


# Rows up to which a linear goes to the kernel, per dtype: a bfloat16 decode batch (ATen's bfloat16 GEMM is a scalar
# fallback without AVX-512-BF16); a prefill chunk keeps ATen's GEMM. float32 goes to packed weights instead (`pack`).
MAX_LINEAR_ROWS = {torch.bfloat16: 64}

# NOTE: oneDNN compiles a primitive per GEMM shape (row count x weight) and keeps it in two LRU caches, ideep's and
# oneDNN's own, 1,024 entries each by default and up to a few MiB an entry: a replica that met every row count from 1
# to 1,024 grew by 3 GiB. A step meets at most two row counts (its batch, the sampled rows) times five weight shapes,
# so 16 entries keep its hits; a miss re-creates a primitive in about 0.2 ms. Both read these variables at their first
# use, which is this process's first packed linear (an operator's own setting wins).
ONEDNN_CACHE_ENTRIES = 16
for _var in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
    os.environ.setdefault(_var, str(ONEDNN_CACHE_ENTRIES))


def can_pack(dtype: torch.dtype = torch.float32) -> bool:
    """Whether linear weights of `dtype` get a packed copy here (`pack_chunks`): float32 where our GEMM (`panels_for`)
    or oneDNN is built in; bfloat16 where the CPU computes in bfloat16 (`native_bf16`), else the bfloat16 kernel of
    ours (`linear`) stays."""
    if dtype == torch.float32 and _our_gemm():
        return True
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16())


def native_bf16() -> bool:
    """Whether this CPU computes in bfloat16 (AVX-512-BF16 or AMX) for oneDNN. NOTE: oneDNN also takes bfloat16 on
    AVX-512 without them (`_is_mkldnn_bf16_supported` says yes), converting in software: on such a Xeon its linears of
    the bench model took 1.08x our kernel's time at 1 row, 1.99x at 8 and 1.79x at 32 (one thread, 2026-11-28)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported() and (
        torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    )


def panels_for(weight: torch.Tensor) -> bool:
    """Whether `pack_chunks` lays `weight` out in panels for our float32 GEMM (cpu_gemm.h) instead of oneDNN's layout:
    float32, a kernel build with AVX2, and output features a multiple of 16. On this project's AVX2 VM it took
    0.57-0.64x oneDNN's time on the bench model's linears at 1-32 rows, streamed from memory as a decode step does,
    0.79x at 64, 0.9x at 256-1,024 (`make bench-kernels`). On an AVX-512 Xeon, one thread with the helper as a served
    step runs them, 0.54x, 0.50x, 0.59x and 1.04x oneDNN's chunks' time at 1, 2, 8 and 32 rows, but 1.25-1.84x MKL's
    (two threads) at 64-256 rows, where oneDNN's and MKL's kernels are twice as wide: there rows past
    `AVX512_PANEL_ROWS` go to torch's linear on the weight itself (BENCHMARKS.md, 2026-11-28 18:40 UTC)."""
    return weight.dtype == torch.float32 and _our_gemm() and weight.shape[0] % 16 == 0


# On AVX-512 CPUs, float32 linears of more rows than this (prefill chunks) go to torch's (MKL's) GEMM (`panels_for`).
AVX512_PANEL_ROWS = 32


def _our_gemm() -> bool:
    """Our float32 GEMM is built here and takes float32 linears: an AVX2 build (see `panels_for`)."""
    return hasattr(_module, "panel_linear")


def panels(weight: torch.Tensor) -> torch.Tensor:
    """weight (N, K) float32 -> (N / 16, K, 16): each 16 output features' weights K-major, on huge pages (as the
    model's weights: a decode step streams them)."""
    n, k = weight.shape
    out = hugepages.empty(n * k, torch.float32).view(n // 16, k, 16)
    return out.copy_(weight.detach().view(n // 16, 16, k).transpose(1, 2))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 or bfloat16 weight (N, K) in oneDNN's blocked layout for `linear(..., packed=)`: an opaque tensor, a
    second copy. NOTE: ATen's float32 linear is MKL's sgemm, which repacks the weight on every call; a decode step's
    GEMMs have few rows, so that repacking is a large share of them (vLLM's CPU backend prepacks for oneDNN too). In
    bfloat16, on a CPU with AVX-512-BF16, oneDNN on the packed copy measured 2.9x our kernel at 32 rows (whose
    float32 FMAs on widened weights are for CPUs without it) and 1.1x ATen's bfloat16 GEMM (BENCHMARKS.md)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)  # laid out for ~32 rows; any count works


# A weight's column chunks when it is packed for sharing (`pack_chunks`): with 4, a helper preempted mid-chunk costs
# the caller a quarter of the linear again, at most; more chunks cost more oneDNN calls (~30 us each here).
SHARE_CHUNKS = 4


def pack_chunks(weight: torch.Tensor, chunks: int = SHARE_CHUNKS) -> tuple[torch.Tensor, ...]:
    """`pack(weight)` as `chunks` packed slices of equal height (rows of weight, columns of the output) for
    `linear`, whose calls then share the chunks with the helper thread; one slice where the height does not split
    into multiples of 8. Float32 weights that `panels_for` takes: `(panels(weight),)`, whatever `chunks`."""
    if panels_for(weight):  # one tensor: panel_linear splits it into the helper's tasks when it is called
        return (panels(weight),)
    n = weight.shape[0]
    k = next((c for c in range(chunks, 1, -1) if n % c == 0 and n // c % 8 == 0), 1)
    return tuple(pack(w) for w in weight.chunk(k))


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """F.linear(x (T, K), weight (N, K), bias): on `packed` (pack_chunks(weight)) where given, by our GEMM on its
    panels (on AVX-512 CPUs up to AVX512_PANEL_ROWS rows, torch's GEMM past them) or by oneDNN on its packed chunks
    (which the helper thread shares); by the bfloat16 kernel where it applies (AVX2 builds, T <= MAX_LINEAR_ROWS[dtype],
    K a multiple of 8); else by torch."""
    global calls
    if packed is not None and not torch.compiler.is_compiling():
        first = packed[0] if isinstance(packed, tuple) else packed
        if first.layout == torch.strided and x.dtype == torch.float32:  # panels: our GEMM
            rows = x.numel() // x.shape[-1]
            if rows > AVX512_PANEL_ROWS and _module.avx512:
                return F.linear(x, weight, bias)
            calls += 1
            y = _module.panel_linear(x.reshape(-1, x.shape[-1]), first, bias)
            return y.view(*x.shape[:-1], y.shape[-1])
        if isinstance(packed, tuple) and len(packed) > 1 and x.dtype == packed[0].dtype:
            calls += 1
            y = _module.chunked_linear(x.reshape(-1, x.shape[-1]), packed, bias)
            return y.view(*x.shape[:-1], y.shape[-1])
        packed = packed[0] if isinstance(packed, tuple) else packed
        if x.dtype == packed.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if (
        x.dim() == 2
        and x.shape[0] <= MAX_LINEAR_ROWS.get(x.dtype, 0)
        and x.shape[1] % 8 == 0
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and on(x)
        and hasattr(_module, "linear")
    ):
        calls += 1
        return _module.linear(x, weight, bias)
    return F.linear(x, weight, bias)


__all__ = [
    "MAX_LINEAR_ROWS",
    "add_rms_norm",
    "available",
    "can_pack",
    "linear",
    "load",
    "on",
    "helper_on",
    "helper_stats",
    "pack",
    "pack_chunks",
    "paged_decode_cpu",
    "panels",
    "panels_for",
    "rope_",
    "use_helper",
]
