"""The engine's CPU kernels (llm/model/cpu_kernels.cpp, cpu_attention.cpp), built at replica start: paged decode
attention that reads the KV blocks in place, and one-op versions of what torch runs as several small ops per layer:
the residual add fused into RMSNorm, and RoPE. Each rounds where the torch ops it replaces round (to the model's
dtype between ops), so they compute the same thing; tests hold both paths to transformers. SiLU-mul stays torch's two
ops: torch's vectorised exp beat a plain C++ loop (BENCHMARKS.md has what each kernel bought). Linears run on oneDNN
on packed copies of their weights (`pack`): float32 everywhere, bfloat16 where oneDNN has bfloat16 kernels for the
CPU (AVX-512). Elsewhere a bfloat16 linear of a few rows (decode batches) goes to a kernel of ours: without them ATen
runs bfloat16 GEMMs in a scalar fallback; ours widens each weight to float32 in registers and feeds FMAs (AVX2
builds).

Attention: the eager path (llm/model/attention.py) gathers every decode row's blocks into a contiguous copy, then runs
two batched matmuls. This kernel reads each key and value once, where it lies: one task per (sequence, KV head),
the KV head's keys loaded once for its whole GQA group of query heads; scores, a float32 softmax and the weighted
sum of values per task, nothing materialised but the scores. Keys past a row's context are never read. NOTE: the
kernels run on the calling thread (built without -fopenmp, so at::parallel_for is serial: a second OpenMP runtime
next to torch's libgomp is not worth it), without the GIL; once `use_helper(True)`, the attention's tasks, and the
column chunks of linears on weights packed in chunks (`pack_chunks`, cpu_linear.cpp), are shared with a helper
thread that takes them while it runs, and the caller never waits for one it has not started (cpu_share.h: a core
the node leaves partly idle helps without a preempted thread stalling the step). The idea is
vLLM's and SGLang's CPU decode kernels (paged attention per sequence and head); the code is ours.

The kernels are compiled with torch's cpp_extension (ninja, the machine's C++ compiler, -O3 -march=native) the
first time a process asks for them; the build is cached under TORCH_EXTENSIONS_DIR, so later processes load it in
about a second. Where they cannot be built (no compiler), `load()` says why once and returns None, and the layers
keep torch's ops (and attention the gather).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(n) for n in ("cpu_kernels.cpp", "cpu_attention.cpp", "cpu_linear.cpp")]
_HEADERS = [Path(__file__).with_name(n) for n in ("cpu_simd.h", "cpu_share.h")]
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno"]

_lock = threading.Lock()
# Kernel calls so far: the dispatcher does not see these calls, so op counts (tests, `make bench-kernels`) add them.
calls = 0
_module: object | None = None
_tried = False
_helper = False


def _cpu_key() -> str:
    """A short hash of this CPU's instruction-set flags: a build with -march=native is cached per kind of CPU, so a
    cache shared between machines (a home directory on NFS, an image) never hands one CPU another's build."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def build_name(torch_includes: list[str]) -> str:
    """The build's name (its directory under TORCH_EXTENSIONS_DIR): this CPU's kind, then a hash of the sources and of
    everything else the build command names (the sources' paths, torch's headers, the flags), so checkouts of other
    versions (a baseline in `make bench-kernels`, a second work tree) and one venv reached by two paths (a symlink)
    keep one build each instead of rebuilding over each other."""
    paths = [str(f) for f in _SOURCES] + torch_includes + FLAGS
    text = b"".join(f.read_bytes() for f in _SOURCES + _HEADERS) + "\0".join(paths).encode()
    return f"vlm_cpu_kernels_{_cpu_key()}_{hashlib.sha256(text).hexdigest()[:8]}"


@contextlib.contextmanager
def _builder_lock(name: str):
    """Hold an flock on the build directory while building, and remove a `lock` file that no one holds.

    NOTE: torch's cpp_extension marks a build in progress with a plain `lock` file and waits, forever, while one
    exists; a process killed mid-build (a replica restarted, a test run interrupted) leaves it behind, and every later
    replica start hangs. An flock dies with its process: whoever holds it is the only builder alive, so a `lock` file
    it finds is stale."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, verbose=False))
    with open(build_dir / "builder.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield


@contextlib.contextmanager
def _pinned_ninja():
    """The build runs the ninja requirements.txt pins (the `ninja` package's binary), not whichever `ninja` comes first
    on PATH. NOTE: the pinned 1.13 and a distribution's 1.11 do not agree on a command's hash in `.ninja_log`: a
    process with the venv's bin on PATH (a `ray start` from it) and one without (`.venv/bin/python`, and the replicas
    it starts) each took the other's build for a changed command and rebuilt all of it (~100 s on 2 cores)."""
    try:
        import ninja

        bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):  # not installed: torch looks on PATH
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = bin_dir + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


def load():
    """The compiled module, or None where it cannot be built (said once in the log)."""
    global _module, _tried
    with _lock:
        if not _tried:
            _tried = True
            from torch.utils.cpp_extension import include_paths
            from torch.utils.cpp_extension import load as build

            t0 = time.monotonic()
            try:
                name = build_name(include_paths())
                with _builder_lock(name), _pinned_ninja():
                    _module = build(name, sources=[str(f) for f in _SOURCES], extra_cflags=FLAGS, verbose=False)
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


def rope_(qkv: torch.Tensor, cis: torch.Tensor) -> None:
    """Rotate the first cis.shape[1] heads of qkv (T, H, hd) in place; cis (T, n, hd/2, 2) float32 (cos, sin)."""
    global calls
    calls += 1
    _module.rope_(qkv, cis)


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
# fallback without AVX-512-BF16); a prefill chunk keeps ATen's GEMM. float32 goes to oneDNN on prepacked weights
# (`pack`) instead: our kernel beat MKL's sgemm on up to 8 rows of a cache-resident weight, but not in a whole decode
# step, which streams the weights from memory (BENCHMARKS.md).
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
    """Whether this torch can hold linear weights of `dtype` in oneDNN's packed layout (`pack`): float32 wherever
    oneDNN is built in; bfloat16 where oneDNN also has bfloat16 kernels for this CPU (AVX-512: native with
    AVX-512-BF16), else the bfloat16 kernel of ours (`linear`) stays."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


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
    into multiples of 8."""
    n = weight.shape[0]
    k = next((c for c in range(chunks, 1, -1) if n % c == 0 and n // c % 8 == 0), 1)
    return tuple(pack(w) for w in weight.chunk(k))


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """F.linear(x (T, K), weight (N, K), bias): by oneDNN on `packed` (pack(weight), or pack_chunks(weight), whose
    chunks the helper thread shares) where given, by the bfloat16 kernel where it applies (AVX2 builds, T <=
    MAX_LINEAR_ROWS[dtype], K a multiple of 8), else by torch."""
    global calls
    if packed is not None and not torch.compiler.is_compiling():
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
    "rope_",
    "use_helper",
]
