"""The linear kernel for bfloat16 decode rows (llm/model/cpu_kernels.cpp) against the float32 product rounded once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llm.model import cpu_kernels


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
    with cpu_kernels._builder_lock("probe"):
        build_dir = next(tmp_path.rglob("probe"))
    (build_dir / "lock").touch()  # what a build killed half-way leaves behind
    with cpu_kernels._builder_lock("probe"):
        assert not (build_dir / "lock").exists()
