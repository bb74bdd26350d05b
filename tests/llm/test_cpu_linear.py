"""The linear kernel for bfloat16 decode rows (llm/model/cpu_kernels.cpp) against the float32 product rounded once, and
the linears on oneDNN-packed weights (float32; bfloat16 where oneDNN has bfloat16 kernels) against torch's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from llm.model import cpu_build, cpu_kernels
from llm.model.layers import Linear, RowParallelLinear, pack_linears
from llm.model.parallel import TPGroup


@pytest.fixture(scope="module")
def kernel():
    assert cpu_kernels.load() is not None, "the CPU kernels must build here (C++ compiler and ninja)"
    if not hasattr(cpu_kernels.load(), "linear"):
        pytest.skip("this CPU has no AVX2 + FMA: bfloat16 linears stay torch's")
    return cpu_kernels


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 7, 9, 33, 64])
@pytest.mark.parametrize("N,K", [(1, 8), (3, 16), (5, 512), (100, 64), (1027, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_is_the_float32_product_rounded_once(kernel, T, N, K, bias):
    g = torch.Generator().manual_seed(T * 1000 + N + K)
    x = torch.randn(T, K, generator=g).bfloat16()
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    calls = kernel.calls
    y = kernel.linear(x, w, b)
    assert kernel.calls == calls + 1  # the kernel ran, not torch
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())  # (T, N) float32
    assert y.dtype == torch.bfloat16 and y.shape == (T, N)
    # float32 sums in another order: at most one bfloat16 rounding step apart
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-3 * K**0.5)


@pytest.mark.parametrize("T", [1, 5, 33])
@pytest.mark.parametrize("N", [1027, 1024, 100])
def test_bf16_linear_split_over_a_team_or_with_the_helper_is_the_same(kernel, T, N):
    """The weight rows split over the caller's OpenMP team, or in column blocks shared with the helper thread, give
    the very values one thread gives (each output column is the same sum in the same order)."""
    g = torch.Generator().manual_seed(T + N)
    x, w, b = torch.randn(T, 256, generator=g).bfloat16(), torch.randn(N, 256, generator=g).bfloat16(), None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernel.linear(x, w, b)
        kernel.use_helper(True, delay_us=50)  # the helper slowed down: the caller takes some blocks over from it
        shared = [kernel.linear(x, w, b) for _ in range(20)]
        kernel.use_helper(False)
        torch.set_num_threads(2)
        team = kernel.linear(x, w, b)
    finally:
        kernel.use_helper(False)
        torch.set_num_threads(threads)
    for y in [*shared, team]:
        torch.testing.assert_close(y, alone, atol=0, rtol=0)


def test_what_the_kernel_does_not_take_goes_to_torch(kernel):
    calls = kernel.calls
    w = torch.randn(16, 24).bfloat16()
    for x in (
        torch.randn(kernel.MAX_LINEAR_ROWS[torch.bfloat16] + 1, 24).bfloat16(),  # a prefill chunk
        torch.randn(4, 24),  # float32
        torch.randn(2, 3, 24).bfloat16(),
    ):  # not (T, K)
        y = kernel.linear(x, w.to(x.dtype), None)
        torch.testing.assert_close(y, F.linear(x, w.to(x.dtype)))
    kernel.linear(torch.randn(2, 12).bfloat16(), torch.randn(4, 12).bfloat16(), None)  # K not a multiple of 8
    kernel.linear(torch.randn(2, 24).bfloat16(), w.t().contiguous().t(), None)  # a weight that is not contiguous
    assert kernel.calls == calls


def test_a_build_lock_left_by_a_killed_build_is_removed(tmp_path, monkeypatch):
    """torch waits forever on a `lock` file in the build directory; one that no live builder holds goes."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with cpu_build._builder_lock("probe"):
        build_dir = next(tmp_path.rglob("probe"))
    (build_dir / "lock").touch()  # what a build killed half-way leaves behind
    with cpu_build._builder_lock("probe"):
        assert not (build_dir / "lock").exists()


def test_a_build_is_named_for_the_paths_its_command_names():
    """One venv reached by two paths (a symlink: Ray's workers resolve it, the driver may not) writes two build
    commands; each gets its own build directory instead of rebuilding over the other's."""
    venv = "/srv/app/.venv/lib/python3.11/site-packages/torch/include"
    resolved = "/tmp/r/.venv/lib/python3.11/site-packages/torch/include"
    assert cpu_build.build_name([venv]) == cpu_build.build_name([venv])
    assert cpu_build.build_name([venv]) != cpu_build.build_name([resolved])
    assert cpu_build.build_name([venv]).startswith("vlm_cpu_kernels_")


@pytest.mark.slow  # a fresh interpreter loads the built kernels (~10 s)
def test_the_build_runs_the_pinned_ninja_whatever_comes_first_on_path(kernel, tmp_path):
    """A `ninja` of another version first on PATH (a distribution's 1.11 beside the pinned 1.13: they hash build
    commands differently, so each rebuilt the other's build): loading the built kernels never runs it."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ninja").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "ran"}\nexit 1\n')
    (fake / "ninja").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    code = "from llm.model import cpu_kernels; assert cpu_kernels.load() is not None"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and not (tmp_path / "ran").exists(), done.stderr[-3000:]


@pytest.mark.parametrize("avx512", [False, True])
def test_on_avx512_cpus_prefill_rows_leave_the_panels_for_torch(kernel, monkeypatch, avx512):
    """On an AVX-512 CPU float32 linears of up to AVX512_PANEL_ROWS rows run on our GEMM's panels, more rows on torch's
    GEMM (whose kernels are twice as wide there); elsewhere the panels take every row count."""
    if not cpu_kernels.panels_for(torch.empty(16, 8)):
        pytest.skip("our float32 GEMM does not run on this CPU (no AVX2)")
    monkeypatch.setattr(kernel.load(), "avx512", avx512)
    layer = Linear(64, 48, bias=True)
    assert pack_linears(layer) == 1
    for rows in (1, kernel.AVX512_PANEL_ROWS, kernel.AVX512_PANEL_ROWS + 1, 200):
        x, calls = torch.randn(rows, 64), kernel.calls
        with torch.inference_mode(), _Ops() as ops:
            y = layer(x)
        on_torch = avx512 and rows > kernel.AVX512_PANEL_ROWS
        assert kernel.calls == calls + (not on_torch)
        assert any("mm" in n or "linear" in n for n in ops.names) == on_torch, ops.names
        torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


class _Ops(TorchDispatchMode):
    """The names of the ops dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("T", [1, 3, 32, 200])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("N", [1024, 1027])
def test_packed_float32_linears_equal_torch_and_run_on_the_packed_copy(float32_packing, T, bias, N):
    """On our GEMM's panels (one kernel call per linear, which a dispatch mode does not see) or oneDNN's packed copy;
    a weight whose output features do not split into panels of 16 (1027) goes to oneDNN either way."""
    torch.manual_seed(T)
    model = nn.Sequential(Linear(512, N, bias=bias), RowParallelLinear(N, 64, bias, TPGroup()))
    for p in model.parameters():
        nn.init.normal_(p, std=0.05)
    x = torch.randn(T, 512)
    with torch.no_grad():
        ref = F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight, model[1].bias)
        assert pack_linears(model) == 2
        calls = cpu_kernels.calls
        with _Ops() as ops:
            y = model(x)
    onednn = 2 if float32_packing == "onednn" else int(N % 16 != 0)
    assert [n for n in ops.names if "linear" in n or "mm" in n] == ["mkldnn._linear_pointwise.default"] * onednn
    assert cpu_kernels.calls == calls + 2 - onednn
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


ONEDNN_BF16 = (
    cpu_kernels.can_pack() and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
)


def test_bfloat16_weights_are_packed_only_where_the_cpu_computes_in_bfloat16(monkeypatch):
    """oneDNN takes bfloat16 on any AVX-512 CPU, in software where the CPU has neither AVX-512-BF16 nor AMX (slower
    than our kernel there): those keep our kernel."""
    for avx512_bf16, amx in ((False, False), (True, False), (False, True)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert cpu_kernels.can_pack(torch.bfloat16) == (ONEDNN_BF16 and (avx512_bf16 or amx))


@pytest.mark.skipif(not ONEDNN_BF16, reason="oneDNN has no bfloat16 kernels for this CPU")
@pytest.mark.parametrize("T", [1, 3, 32, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bfloat16_linears_are_the_float32_product_rounded_once(T, bias, monkeypatch):
    """Where oneDNN takes bfloat16 (AVX-512; here as on a CPU that computes in it), bfloat16 weights are packed too and
    every row count runs on them: the float32 product, rounded once to bfloat16, as torch's own bfloat16 linear and
    our kernel compute it."""
    monkeypatch.setattr(cpu_kernels, "native_bf16", lambda: True)
    torch.manual_seed(T)
    model = nn.Sequential(Linear(512, 1027, bias=bias), RowParallelLinear(1027, 64, bias, TPGroup())).bfloat16()
    for p in model.parameters():
        nn.init.normal_(p, std=0.05)
    x = torch.randn(T, 512).bfloat16()
    with torch.no_grad():
        hidden = F.linear(x.float(), model[0].weight.float(), None if not bias else model[0].bias.float())
        assert pack_linears(model) == 2
        with _Ops() as ops:
            y0 = model[0](x)
            y = model[1](y0)
    assert [n for n in ops.names if "linear" in n or "mm" in n] == ["mkldnn._linear_pointwise.default"] * 2
    assert y.dtype == torch.bfloat16 and y.shape == (T, 64)
    torch.testing.assert_close(y0.float(), hidden, rtol=2**-7, atol=1e-3 * 512**0.5)
    ref = F.linear(y0.float(), model[1].weight.float(), None if not bias else model[1].bias.float())
    torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-3 * 1027**0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_packs_cpu_linears_unless_told_not_to(checkpoint, dtype):
    from llm import Engine, EngineConfig, Qwen2LM

    for packed in (True, False):
        model = Qwen2LM.from_pretrained(checkpoint).to(dtype)
        config = EngineConfig(max_model_len=256, num_blocks=32, cpu_packed_weights=packed)
        engine = Engine(model, config, image_token_id=-1, merge_size=2, eos_token_ids=set())
        engine.close()
        linears = [m for m in model.modules() if isinstance(m, Linear | RowParallelLinear)]
        assert linears and all((m.packed is not None) == (packed and cpu_kernels.can_pack(dtype)) for m in linears)


_GROWTH = """
import torch
from llm.model import cpu_kernels

torch.set_num_threads(1)
dtype = getattr(torch, "{dtype}")
shapes = ((1024, 512), (2816, 512), (512, 1408), (512, 512))
weights = [cpu_kernels.pack(torch.randn(n, k, dtype=dtype)) for n, k in shapes]

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

def rows(counts):
    for t in counts:
        for w in weights:
            cpu_kernels.linear(torch.randn(t, w.size(1), dtype=dtype), None, None, w)

rows(range(1, 40))
start = rss_mib()
rows(range(40, 340, 2))
print(rss_mib() - start)
"""


@pytest.mark.slow  # a fresh interpreter, 190 row counts x 4 weights (9-14 s)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_linears_memory_stays_bounded_over_many_row_counts(dtype):
    if not (cpu_kernels.can_pack() if dtype == "float32" else ONEDNN_BF16):
        pytest.skip(f"this torch has no oneDNN weight packing in {dtype} here")
    # oneDNN caches a compiled primitive per row count and weight shape (cpu_kernels.ONEDNN_CACHE_ENTRIES): 150 row
    # counts x 4 weights grew a process by ~700 MiB before the caches were capped; capped, a few dozen.
    code = _GROWTH.replace("{dtype}", dtype)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert float(out.stdout.strip()) < 150, out.stdout
