"""The layers' small CPU kernels (llm/model/cpu_kernels.cpp) against the torch ops they replace: SiLU-mul, and RoPE
with the KV write."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llm.model import cpu_kernels
from llm.model.attention import write_kv
from llm.model.layers import Rotary

NH, NKV, HD, BS, BLOCKS = 8, 4, 64, 16, 12


@pytest.fixture(scope="module")
def kernels():
    assert cpu_kernels.load() is not None, "the CPU kernel must build here (C++ compiler and ninja)"
    return cpu_kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,inter", [(1, 1408), (3, 13), (37, 64)])  # 13: not a multiple of 8 (the scalar tail)
def test_silu_mul_is_torchs_silu_times_up(kernels, dtype, T, inter):
    gen = torch.Generator().manual_seed(T)
    gate_up = (torch.randn(T, 2 * inter, generator=gen) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, -88.0, 88.0, 100.0])  # exp's range ends: no inf, no nan
    want = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
    got = kernels.silu_mul(gate_up)
    assert got.dtype == dtype and got.shape == (T, inter)
    if dtype == torch.bfloat16:  # rounded where torch rounds: the same bits
        assert torch.equal(got, want)
    else:  # float32: exp to ~2 ulp (not Sleef's)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5])
def test_rope_with_the_kv_write_is_rotary_then_write_kv(kernels, dtype, T):
    gen = torch.Generator().manual_seed(T)
    qkv = torch.randn(T, NH + 2 * NKV, HD, generator=gen).to(dtype)
    positions = torch.randint(0, 4000, (1, T), generator=gen).expand(3, -1)
    cis = Rotary(HD, 10000.0, 4096, None).step(positions, NH, NKV)
    cache = torch.randn(2 * NKV, BLOCKS, BS, HD, generator=gen).to(dtype)
    slots = torch.randperm(BLOCKS * BS, generator=gen)[:T]
    want_qkv, want_cache = qkv.clone(), cache.clone()
    Rotary.apply_(want_qkv, cis)
    write_kv(want_cache, slots, want_qkv[:, NH:])
    kernels.rope_(qkv, cis, cache, slots)
    # torch rotates as one complex multiply, in float32: its roundings may differ from the kernel's by an ulp.
    tol = 1e-6 if dtype == torch.float32 else 2**-7  # a bfloat16 ulp
    torch.testing.assert_close(qkv, want_qkv, rtol=tol, atol=1e-6)
    flat = cache.view(2 * NKV, -1, HD)
    assert torch.equal(flat[:, slots], qkv[:, NH:].transpose(0, 1))  # the keys as rotated, and the values
    untouched = torch.ones(BLOCKS * BS, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], want_cache.view(2 * NKV, -1, HD)[:, untouched])


def test_a_slot_outside_the_cache_is_refused(kernels):
    qkv = torch.randn(2, NH + 2 * NKV, HD)
    cis = Rotary(HD, 10000.0, 64, None).step(torch.zeros(3, 2, dtype=torch.long), NH, NKV)
    cache = torch.zeros(2 * NKV, BLOCKS, BS, HD)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.rope_(qkv, cis, cache, torch.tensor([0, BLOCKS * BS]))
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.rope_(qkv, cis, cache, torch.tensor([-1, 0]))
