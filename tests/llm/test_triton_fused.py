"""The layers' Triton kernels (llm/model/triton_fused.py, llm/model/triton_gemm.py) against the torch ops they
replace: each kernel alone, then a whole decode step and a prefill with the kernels against without; in Triton's
interpreter on CPU (a child pytest, as in test_triton_attention.py), compiled on cuda when there is one, and compiled
for an H100 without one.
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from demo.op_count import OpCount
from llm.model import gemm_kernel, triton_attention, triton_fused, triton_gemm
from llm.model.attention import BatchMeta, ChunkSpec, StaticMeta, write_kv
from llm.model.gemm_kernel import Fold, RopeKV
from llm.model.layers import Rotary
from tests.llm.test_triton_attention import assert_interpreter_child_passes, compile_for_h100

INTERPRETED = triton_attention._INTERPRETED
needs_triton = pytest.mark.skipif(triton_attention.triton is None, reason="triton is not installed")
in_child = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child of test_fused_cases_pass_in_the_triton_interpreter"
)
DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype):
    """bfloat16: two roundings apart at most (an ulp is 2**-8 relative; the interpreter rounds to bfloat16 by
    truncation, a GPU to nearest)."""
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def check_add_rms_norm(device, dtype, T=5, D=200):
    gen = torch.Generator().manual_seed(0)
    x, delta, w = (torch.randn(*shape, generator=gen).to(device, dtype) for shape in ((T, D), (T, D), (D,)))
    for d in (None, delta):
        ours_x, want_x = x.clone(), x.clone()
        out = triton_fused.add_rms_norm(ours_x, d, w, 1e-6)
        if d is not None:
            want_x.add_(d)
        h = want_x.float()
        want = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * w  # transformers' Qwen2RMSNorm
        exact = dtype == torch.float32 or device == "cuda"  # the residual stream, rounded alike
        torch.testing.assert_close(ours_x, want_x, **(dict(atol=0, rtol=0) if exact else _tol(dtype)))
        torch.testing.assert_close(out, want, **_tol(dtype))


def check_rope_kv_write(device, dtype, nh=4, nkv=2, hd=16, T=3, block_size=4, num_blocks=6):
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(T, nh + 2 * nkv, hd, generator=gen).to(device, dtype)
    rotary = Rotary(hd, 10000.0, 64, (2, 3, 3), device)
    positions = torch.tensor([[3, 9, 40], [3, 11, 40], [3, 2, 40]], device=device)  # (3, T): M-RoPE, axes differ
    cis = rotary.step(positions, nh, nkv)
    slots = torch.tensor([5, 17, 2], device=device)  # scattered through the blocks
    cache = torch.full((2 * nkv, num_blocks, block_size, hd), float("nan"), dtype=dtype, device=device)
    ours_qkv, want_qkv, want_cache = qkv.clone(), qkv.clone(), cache.clone()
    triton_fused.rope_kv_write_(ours_qkv, cis, cache, slots)
    Rotary.apply_(want_qkv, cis)
    write_kv(want_cache, slots, want_qkv[:, nh:])
    torch.testing.assert_close(ours_qkv, want_qkv, **_tol(dtype))
    torch.testing.assert_close(cache, want_cache, equal_nan=True, **_tol(dtype))  # every other slot still NaN


def check_silu_mul(device, dtype, T=3, inter=1500):
    gate_up = (torch.randn(T, 2 * inter, generator=torch.Generator().manual_seed(2)) * 4).to(device, dtype)
    want = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
    torch.testing.assert_close(triton_fused.silu_mul(gate_up), want, **_tol(dtype))


def check_small_gemm(device, dtype, configs=triton_gemm.CONFIGS):
    """Every config against F.linear in float32 on the same values: rows 1-16, sizes that no tile divides, with and
    without bias; the split-K counters are left at zero (a graph replays them)."""
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("float32 stays with cuBLAS (the kernel's tl.dot would round to tf32)")
    gen = torch.Generator().manual_seed(5)
    for M, N, K, bias in ((1, 40, 100, True), (5, 96, 320, False), (16, 33, 600, True)):
        x, w, b = (torch.randn(*shape, generator=gen).to(device, dtype) for shape in ((M, K), (N, K), (N,)))
        want = F.linear(x.float(), w.float(), b.float() if bias else None)
        # float32: K products of N(0, 1)s summed in the tiles' order, not BLAS's: ~sqrt(K) * 2**-24 * |out| apart,
        # and BLAS's order differs by CPU (2e-5 seen at K = 600 on an AMD EPYC). A wrong tile is off by ~1.
        tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else _tol(dtype)
        for config in configs:
            out = gemm_kernel.launch(x, w, b if bias else None, config)
            assert out.dtype == dtype and out.shape == (M, N)
            torch.testing.assert_close(out.float(), want, **tol, msg=lambda m, c=config: f"{c}: {m}")
    assert not any(c.any() for c in triton_attention._counters.values())


def check_gated_gemm(device, dtype, configs=triton_gemm.CONFIGS):
    """down_proj's GEMM with the SiLU-mul in its loads, every config: equal to the same config's GEMM of
    triton_fused.silu_mul's output (the same roundings; the interpreter rounds to bfloat16 by truncation, so against
    torch's SiLU-mul a 16-bit sum of K products drifts apart), and in float32 to F.linear of torch's SiLU-mul; rows
    1-16, widths that no tile divides."""
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("float32 stays with cuBLAS (the kernel's tl.dot would round to tf32)")
    gen = torch.Generator().manual_seed(7)
    for M, N, K, bias in ((1, 40, 100, True), (7, 96, 330, False), (16, 33, 600, True)):
        gate_up = (torch.randn(M, 2 * K, generator=gen) * 3).to(device, dtype)
        w, b = (torch.randn(*shape, generator=gen).to(device, dtype) for shape in ((N, K), (N,)))
        b = b if bias else None
        act = F.silu(gate_up[:, :K].float()) * gate_up[:, K:].float()
        want = F.linear(act, w.float(), None if b is None else b.float())
        for config in configs:
            out = gemm_kernel.launch(gate_up, w, b, config, Fold(gated=True))
            assert out.dtype == dtype and out.shape == (M, N)
            two_kernels = gemm_kernel.launch(triton_fused.silu_mul(gate_up), w, b, config)
            exact = dict(atol=0, rtol=0) if device == "cpu" else _tol(dtype)  # cuda: the compiler may contract
            torch.testing.assert_close(out, two_kernels, **exact, msg=lambda m, c=config: f"{c}: {m}")
            if dtype == torch.float32:
                torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-5, msg=lambda m, c=config: f"{c}: {m}")
    assert not any(c.any() for c in triton_attention._counters.values())


def check_rope_gemm(device, dtype, configs=triton_gemm.CONFIGS):
    """q/k/v's GEMM with RoPE and the KV write in its epilogue, every config: output and cache equal to the same
    config's GEMM then triton_fused.rope_kv_write_ (the same roundings), and in float32 to torch's F.linear,
    Rotary.apply_ and write_kv; tiles that straddle heads (hd 24), rows 1-16, every other cache slot left NaN."""
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("float32 stays with cuBLAS (the kernel's tl.dot would round to tf32)")
    gen = torch.Generator().manual_seed(8)
    for M, nh, nkv, hd, K, bias in ((1, 2, 1, 16, 40, True), (5, 4, 2, 24, 64, False), (16, 6, 2, 8, 48, True)):
        x = torch.randn(M, K, generator=gen).to(device, dtype)
        w = torch.randn((nh + 2 * nkv) * hd, K, generator=gen).to(device, dtype)
        b = torch.randn((nh + 2 * nkv) * hd, generator=gen).to(device, dtype) if bias else None
        positions = torch.randint(0, 60, (3, M), generator=gen).to(device)  # M-RoPE: the axes differ
        cis = Rotary(hd, 10000.0, 64, (hd // 8, hd // 8, hd // 4), device).step(positions, nh, nkv)
        slots = torch.randperm(4 * 8, generator=gen)[:M].to(device)
        cache = torch.full((2 * nkv, 8, 4, hd), float("nan"), dtype=dtype, device=device)
        want = F.linear(x.float(), w.float(), None if b is None else b.float()).view(M, -1, hd)
        want_cache = cache.float()
        Rotary.apply_(want, cis)
        write_kv(want_cache, slots, want[:, nh:])
        for config in configs:
            ours_cache, two_cache = cache.clone(), cache.clone()
            rope = Fold(rope=RopeKV(cis, ours_cache, slots, nh, nkv))
            out = gemm_kernel.launch(x, w, b, config, rope).view(M, -1, hd)
            two_kernels = gemm_kernel.launch(x, w, b, config).view(M, -1, hd)
            triton_fused.rope_kv_write_(two_kernels, cis, two_cache, slots)
            exact = dict(atol=0, rtol=0) if device == "cpu" else _tol(dtype)  # cuda: the compiler may contract
            msg = lambda m, c=config: f"{c}: {m}"  # noqa: E731
            torch.testing.assert_close(out, two_kernels, **exact, msg=msg)
            torch.testing.assert_close(ours_cache, two_cache, **exact, equal_nan=True, msg=msg)
            if dtype == torch.float32:
                torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-5, msg=msg)
                torch.testing.assert_close(ours_cache, want_cache, atol=1e-4, rtol=1e-5, equal_nan=True, msg=msg)
    assert not any(c.any() for c in triton_attention._counters.values())


def _rel(ours: torch.Tensor, want: torch.Tensor) -> float:
    return float((ours.float() - want.float()).nan_to_num().norm() / want.float().nan_to_num().norm())


def check_norm_add_gemm(device, dtype, configs=triton_gemm.CONFIGS):
    """The folds of a decode layer on a residual stream, every config: RMSNorm in the loads (against RMSNorm then
    the product in float32: the norm's output is not rounded to 16 bits, so 16-bit runs are ~1e-3 apart), with RoPE
    and the KV write (against triton_gemm.without, the kernel-free path), and the residual add, alone and after
    SiLU-mul (exactly the same config's product added into the residual)."""
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("float32 stays with cuBLAS (the kernel's tl.dot would round to tf32)")
    gen = torch.Generator().manual_seed(9)
    for M, N, K in ((1, 40, 100), (6, 96, 330), (16, 48, 600)):
        x, w, b, nw = (torch.randn(*shape, generator=gen).to(device, dtype) for shape in ((M, K), (N, K), (N,), (K,)))
        norm = (nw, 1e-6)
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * nw.float()
        want = F.linear(h, w.float(), b.float())
        residual = torch.randn(M, N, generator=gen).to(device, dtype)
        gate_up = torch.randn(M, 2 * K, generator=gen).to(device, dtype)
        for config in configs:
            ours = gemm_kernel.launch(x, w, b, config, Fold(norm=norm))
            assert _rel(ours, want) < (1e-6 if dtype == torch.float32 else 1e-2), config
            for inputs, fold in (
                (x, Fold(add_to=residual.clone())),
                (gate_up, Fold(gated=True, add_to=residual.clone())),
            ):
                alone = gemm_kernel.launch(inputs, w, b, config, Fold(gated=fold.gated))
                summed = gemm_kernel.launch(inputs, w, b, config, fold)
                assert summed is fold.add_to  # in place
                # one rounding of the sum apart at most in 16 bits (the interpreter truncates, torch rounds to nearest)
                exact = dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=1e-6, rtol=2**-7)
                torch.testing.assert_close(summed, residual.clone().add_(alone), **exact)
    nh, nkv, hd, M, K = 2, 1, 16, 5, 64
    x, w, nw = (torch.randn(*shape, generator=gen).to(device, dtype) for shape in ((M, K), (64, K), (K,)))
    cis = Rotary(hd, 10000.0, 64, None, device).step(torch.arange(M, device=device).expand(3, -1), nh, nkv)
    caches = [torch.full((2, 4, 4, hd), float("nan"), dtype=dtype, device=device) for _ in range(2)]
    slots = torch.tensor([3, 9, 4, 15, 0], device=device)
    folds = [Fold((nw, 1e-6), rope=RopeKV(cis, cache, slots, nh, nkv)) for cache in caches]
    for config in configs:
        ours, want = gemm_kernel.launch(x, w, None, config, folds[0]), triton_gemm.without(x, w, None, folds[1])
        assert _rel(ours, want) < (1e-6 if dtype == torch.float32 else 1e-2), config
        assert (caches[0].isnan() == caches[1].isnan()).all() and _rel(*caches) < 1e-2, config
    assert not any(c.any() for c in triton_attention._counters.values())


CHECKS = [check_add_rms_norm, check_rope_kv_write, check_silu_mul, check_small_gemm, check_gated_gemm, check_rope_gemm,
          check_norm_add_gemm]  # fmt: skip


def tiny_model(dtype=torch.float32):
    from demo.build_tiny import build_checkpoint
    from llm import Qwen2LM

    with tempfile.TemporaryDirectory() as d:
        return Qwen2LM.from_pretrained(build_checkpoint(d, seed=3, init_std=0.5), dtype=dtype)


@needs_triton
@pytest.mark.slow
def test_fused_cases_pass_in_the_triton_interpreter():
    assert_interpreter_child_passes(__file__)


@in_child
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("check", CHECKS)
def test_kernel_in_interpreter(check, dtype):
    check("cpu", dtype)


@in_child
def test_choice_adds_into_copies_of_the_residual_in_interpreter(monkeypatch):
    """triton_gemm's choice (its timing made up here) runs every path on copies of the residual stream: the stream is
    summed once, by the chosen path; a config that disagrees is never chosen."""
    times = iter(range(100, 0, -1))  # each timing faster than the one before: the last config that agrees wins
    monkeypatch.setattr(triton_gemm, "_graph_us", lambda fn, reps=20: (fn(), next(times))[1])
    gen = torch.Generator().manual_seed(10)
    x, w, residual = (torch.randn(*shape, generator=gen).to(torch.bfloat16) for shape in ((3, 64), (32, 64), (3, 32)))
    before = residual.clone()
    assert triton_gemm._choose(x, w, None, Fold(add_to=residual)) == triton_gemm.CONFIGS[-1]
    torch.testing.assert_close(residual, before, atol=0, rtol=0)
    monkeypatch.setattr(gemm_kernel, "launch", lambda *args: torch.zeros(3, 32, dtype=torch.bfloat16))  # all wrong
    assert triton_gemm._choose(x, w, None, Fold(add_to=residual)) is None


if triton_attention.triton is not None:
    tl = triton_attention.triton.language

    @triton_attention.triton.jit
    def _span_kernel(bounds_ptr, out_ptr, N, BLOCK_N: tl.constexpr, SPAN: tl.constexpr):
        """gemm_kernel._prefetch_span for each (column block, split) program, given its split's columns."""
        p = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        row, start, n = gemm_kernel._prefetch_span(
            tl.program_id(0), tl.load(bounds_ptr + 2 * p), tl.load(bounds_ptr + 2 * p + 1), N, BLOCK_N, SPAN
        )
        i = tl.arange(0, 128)
        tl.store(out_ptr + p * 384 + i, row)
        tl.store(out_ptr + p * 384 + 128 + i, start)
        tl.store(out_ptr + p * 384 + 256 + i, n)


@in_child
def test_prefetch_covers_each_rows_first_tiles_in_interpreter():
    """PDL's prefetch (gemm_kernel): a program's pieces cover, in each of its weight rows, exactly the first
    BLOCK_K * num_stages columns of its split, once, in whole 16 bytes from 16-byte boundaries; none past the last
    row or in an empty split."""
    for block_n, block_k, split_k, _, stages in triton_gemm.CONFIGS:
        for N, K in ((40, 1536), (96, 8960), (17, 200)):
            k_len = math.ceil(math.ceil(K / split_k) / block_k) * block_k  # as the kernel splits
            n_blocks, span = -(-N // block_n), block_k * stages
            bounds = torch.tensor(
                [[s * k_len, min(s * k_len + k_len, K)] for _ in range(n_blocks) for s in range(split_k)]
            )
            out = torch.zeros(n_blocks * split_k, 3, 128, dtype=torch.int64)
            _span_kernel[(n_blocks, split_k)](bounds, out, N, BLOCK_N=block_n, SPAN=span)
            for p, (rows, starts, ns) in enumerate(out.tolist()):
                k0, k1 = bounds[p].tolist()
                end = min(k0 + span, k1) if k0 < k1 else k0
                for r in range(p // split_k * block_n, (p // split_k + 1) * block_n):
                    pieces = sorted((s, s + n) for row, s, n in zip(rows, starts, ns, strict=True) if row == r and n)
                    assert all(s % 8 == 0 and e % 8 == 0 for s, e in pieces), pieces  # 2- or 4-byte elements
                    if r >= N or k0 == end:
                        assert not pieces, (r, pieces)
                        continue
                    assert (pieces[0][0], pieces[-1][1]) == (k0, end), (block_n, split_k, N, K, p, r, pieces)
                    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), pieces  # no gap, no overlap


class _Counted:
    """A Triton kernel whose launches are counted, run outside the dispatch mode (the interpreter runs aten ops of
    its own, which a GPU launch does not)."""

    def __init__(self, kernel, counter: list[int]):
        self.kernel, self.counter = kernel, counter

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counter[0] += 1
            with _disable_current_modes():
                return self.kernel[grid](*args, **kwargs)

        return launch


@in_child
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_model_with_the_kernels_equals_without_in_interpreter(monkeypatch, dtype):
    """A prefill of two sequences, then a static decode step (Triton attention) of both, with the kernels and with
    torch's ops: in float32 hidden states and cache equal; in bfloat16 the kernels are no further from the float32
    model than torch's ops are. A decoder layer's decode step launches 5 kernels in bfloat16: its four GEMMs,
    triton_gemm's with the layer's small ops folded in (the norms, RoPE and the KV write, SiLU-mul, the residual
    adds), and the attention; 9 ops and kernels in float32 (cuBLAS's GEMMs, the small ops kernels of their own);
    without them 13 in float32, 14 in bfloat16 on CPU (18 on cuda by the profile, with the attention's combine a
    kernel of its own)."""
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(4))  # the tiny model's hidden size
    results, per_layer, launches, gemms = {}, {}, [0], [0]
    for module, names in ((triton_fused, ("_add_rms_norm_kernel", "_rope_kv_kernel", "_silu_mul_kernel")),
                          (triton_attention, ("_split_kernel", "_combine_kernel"))):  # fmt: skip
        for name in names:
            monkeypatch.setattr(module, name, _Counted(getattr(module, name), launches))
    monkeypatch.setattr(gemm_kernel, "_small_gemm_kernel", _Counted(gemm_kernel._small_gemm_kernel, gemms))
    runs = [(dtype, True), (dtype, False)] + ([(torch.float32, False)] if dtype != torch.float32 else [])
    for run_dtype, enabled in runs:
        model = tiny_model(run_dtype)
        monkeypatch.setattr(triton_gemm, "enabled", enabled)
        monkeypatch.setattr(triton_fused, "enabled", enabled)
        cache = model.new_cache(8, 4)  # block 7: the null block
        cache.kv.fill_(float("nan"))  # the free blocks: nothing may read them
        with torch.inference_mode():
            meta = BatchMeta.build([ChunkSpec([1, 3], 0, 6), ChunkSpec([2], 0, 3)], 4, x.device)
            prefill = model(x.to(run_dtype), torch.arange(9).expand(3, -1) + 5, cache, meta)
            static = StaticMeta(torch.tensor([14, 11]), torch.tensor([[1, 3, 7], [2, 7, 7]], dtype=torch.int32),
                                torch.tensor([7, 4], dtype=torch.int32))  # fmt: skip
            counts, layers = [], model.layers
            # The step with one layer (twice: the first allocates the attention's counters), then with both: the
            # difference is one layer's. Writing the same keys to the same slots again changes nothing.
            for n in (1, 1, 2):
                model.layers, before = layers[:n], launches[0] + gemms[0]
                with OpCount() as ops:
                    decode = model(x[:2].to(run_dtype), torch.tensor([[11, 14]]).expand(3, -1), cache, static)
                counts.append(ops.n + launches[0] + gemms[0] - before)
            model.layers = layers
        results[(run_dtype, enabled)] = [t.float() for t in (prefill, decode, cache.kv[:, :, :7])]
        if run_dtype == dtype:
            per_layer[enabled] = counts[2] - counts[1]
    assert results[(dtype, True)][1].isfinite().all()
    if dtype == torch.float32:
        for ours, want in zip(results[(dtype, True)], results[(dtype, False)], strict=True):
            torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5, equal_nan=True)
    else:
        f32 = results[(torch.float32, False)]
        for ours, torchs, want in zip(results[(dtype, True)], results[(dtype, False)], f32, strict=True):
            assert (ours.isnan() == want.isnan()).all()  # the same slots written, the free ones untouched
            errs = [float((t - want).nan_to_num().norm() / want.nan_to_num().norm()) for t in (ours, torchs)]
            assert errs[0] <= 1.5 * errs[1] + 1e-3, errs
    assert per_layer == ({True: 9, False: 13} if dtype == torch.float32 else {True: 5, False: 14}), per_layer
    assert gemms[0] > 0 if dtype == torch.bfloat16 else gemms[0] == 0  # float32 stays with torch's GEMM


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_kernels_compile_for_h100(dtype):
    """Without a GPU: each kernel compiles for sm_90 (a typo in a kernel fails here, not on the first GPU run)."""
    if INTERPRETED:
        pytest.skip("interpreted kernels do not compile")
    i64 = torch.int64
    kernels = [
        compile_for_h100(
            triton_fused._add_rms_norm_kernel,
            dict(x_ptr=dtype, delta_ptr=dtype, w_ptr=dtype, out_ptr=dtype),
            dict(HAS_DELTA=True, BLOCK=2048, num_warps=4, PDL=pdl),
        )
        for pdl in (False, True)
    ]
    kernels.append(
        compile_for_h100(
            triton_fused._rope_kv_kernel,
            dict(qkv_ptr=dtype, cis_ptr=torch.float32, cache_ptr=dtype, slots_ptr=i64),
            dict(NH=12, NKV=2, HALF=64, HALF_P2=64, num_warps=1, PDL=True),
        )
    )
    kernels.append(
        compile_for_h100(
            triton_fused._silu_mul_kernel,
            dict(gate_up_ptr=dtype, out_ptr=dtype),
            dict(BLOCK=1024, num_warps=4, PDL=True),
        )
    )
    f32, i32 = torch.float32, torch.int32
    pointers = dict(x_ptr=dtype, w_ptr=dtype, b_ptr=dtype, y_ptr=dtype, part_ptr=f32, ssq_ptr=f32, count_ptr=i32)
    pointers |= dict(norm_ptr=dtype, cis_ptr=f32, cache_ptr=dtype, slots_ptr=i64)
    # (GATED, NORM, ADD, RoPE heads): plain; down_proj, o_proj and gate_up folded; q/k/v with its norm and RoPE
    folds = ((False, False, False, (0, 0)), (True, False, True, (0, 0)), (False, False, True, (0, 0)),
             (False, True, False, (0, 0)), (False, True, False, (12, 2)))  # fmt: skip
    gemms = []  # each GEMM variant's PDL, and with it PREFETCH
    for block_n, block_k, split_k, warps, stages in triton_gemm.CONFIGS if dtype == torch.bfloat16 else ():
        for gated, norm, add, rope in folds:
            constexprs = dict(HAS_BIAS=True, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, UPCAST=False)
            constexprs |= dict(GATED=gated, NORM=norm, ADD=add, ROPE_NH=rope[0], ROPE_NKV=rope[1], HEAD_DIM=128)
            constexprs |= dict(num_warps=warps, num_stages=stages, PDL=gated, PREFETCH=block_k * stages if gated else 0)
            kernels.append(compile_for_h100(gemm_kernel._small_gemm_kernel, dict(pointers), constexprs))
            gemms.append(gated)
    # llm/model/pdl.py: with PDL every program waits for the kernel before it (first thing), without it none does
    assert ["griddepcontrol.wait" in k.asm["ptx"] for k in kernels[:4]] == [False, True, True, True]
    # with PREFETCH the GEMM's programs prefetch their first weight tiles before that wait, and only then
    prefetched = [k.asm["ptx"].find("cp.async.bulk.prefetch.L2") for k in kernels[4:]]
    assert [at >= 0 for at in prefetched] == gemms, prefetched
    waits = [k.asm["ptx"].find("griddepcontrol.wait") for k in kernels[4:]]
    assert all(at < wait for at, wait in zip(prefetched, waits, strict=True) if at >= 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("check", CHECKS)
def test_kernel_on_cuda(check, dtype):
    check("cuda", dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_small_gemm_choice_and_graph_replay_on_cuda(caplog):
    """triton_gemm.linear measures the configs against cuBLAS once per shape and gating (logged) and keeps the
    choice; a split-K launch captured in a CUDA graph gives the right product on every replay (its counters reset
    themselves)."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    for N, K in ((2048, 1536), (1536, 8960)):
        x = torch.randn(8, K, device="cuda", generator=gen, dtype=torch.bfloat16)
        w = (torch.randn(N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        with caplog.at_level("INFO", logger="llm.model.triton_gemm"):
            y = triton_gemm.linear(x, w, None)
        assert (N, K, torch.bfloat16, (False,) * 4) in triton_gemm._choice and f"{N} x {K}" in caplog.text
        torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)
    gate_up = torch.randn(8, 2 * 8960, device="cuda", generator=gen, dtype=torch.bfloat16)  # down_proj, gated
    with caplog.at_level("INFO", logger="llm.model.triton_gemm"):
        y = triton_gemm.linear(gate_up, w, None, Fold(gated=True))
    assert (1536, 8960, torch.bfloat16, Fold(gated=True).key()) in triton_gemm._choice and "(SiLU-mul)" in caplog.text
    want = F.linear(triton_fused.silu_mul(gate_up).float(), w.float())
    torch.testing.assert_close(y.float(), want, atol=2e-2, rtol=2e-2)
    x, w = x[:, :1536], (torch.randn(2048, 1536, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)  # q/k/v
    cis = Rotary(128, 1e6, 64, None, "cuda").step(torch.arange(8, device="cuda").expand(3, -1), 12, 2)
    cache = torch.zeros(4, 4, 16, 128, dtype=torch.bfloat16, device="cuda")
    rope = RopeKV(cis, cache, torch.arange(8, device="cuda") * 3, 12, 2)
    with caplog.at_level("INFO", logger="llm.model.triton_gemm"):
        y = triton_gemm.linear(x, w, None, Fold(rope=rope))
    assert (2048, 1536, torch.bfloat16, Fold(rope=rope).key()) in triton_gemm._choice and "(RoPE/KV)" in caplog.text
    want = F.linear(x, w).view(8, 16, 128)
    triton_fused.rope_kv_write_(want, cis, cache_want := torch.zeros_like(cache), rope.slots)
    torch.testing.assert_close(y.view(8, 16, 128).float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cache.float(), cache_want.float(), atol=2e-2, rtol=2e-2)
    residual, out = (torch.randn(8, 1536, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    before, w = residual.clone(), (torch.randn(1536, 1536, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    assert triton_gemm.linear(out, w, None, Fold(add_to=residual)) is residual  # o_proj, into the residual stream
    want = before.float() + F.linear(out.float(), w.float())
    torch.testing.assert_close(residual.float(), want, atol=3e-2, rtol=2e-2)  # summed once, timing runs aside
    config = next(c for c in triton_gemm.CONFIGS if c[2] > 1)
    graph = torch.cuda.CUDAGraph()
    gemm_kernel.launch(x, w, None, config)  # compiled before the capture
    with torch.cuda.graph(graph):
        y = gemm_kernel.launch(x, w, None, config)
    for _ in range(3):
        x.normal_(generator=gen)
        graph.replay()
        torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)


def test_pdl_launches_only_on_cuda(monkeypatch):
    """llm/model/pdl.py: off, no kernel waits; on, still none off cuda (the interpreter has no griddepcontrol)."""
    from llm.model import pdl

    assert pdl.kwargs(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "enabled", True)
    assert pdl.kwargs(torch.device("cpu")) == {"PDL": False}


@needs_triton
def test_prefetch_only_with_pdl_and_whole_16_bytes(monkeypatch):
    """gemm_kernel.launch asks for the prefetch (the pipeline's first BLOCK_K * num_stages columns) only when PDL
    launches the kernel, pdl.prefetch is on, and every piece is whole 16 bytes at a 16-byte boundary."""
    from llm.model import pdl

    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(kwargs["PREFETCH"])

    monkeypatch.setattr(gemm_kernel, "_small_gemm_kernel", Kernel())
    config = triton_gemm.CONFIGS[0]  # (16, 256, 1, 4, 4)
    x, w = torch.zeros(2, 1536, dtype=torch.bfloat16), torch.zeros(64, 1536, dtype=torch.bfloat16)
    gemm_kernel.launch(x, w, None, config)  # PDL off (cpu)
    monkeypatch.setattr(pdl, "kwargs", lambda device: dict(PDL=True, launch_pdl=True))
    gemm_kernel.launch(x, w, None, config)
    gemm_kernel.launch(x[:, :100], w[:, :100], None, config)  # rows of 200 bytes: pieces would straddle 16 bytes
    gemm_kernel.launch(x[:, 8:], w[:, 8:], None, config)  # rows from 16 bytes in: aligned
    gemm_kernel.launch(x[:, 4:1532], w[:, 4:1532], None, config)  # from 8 bytes in: not
    monkeypatch.setattr(pdl, "prefetch", False)
    gemm_kernel.launch(x, w, None, config)
    assert seen == [0, 1024, 0, 1024, 0, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pdl_changes_no_output_in_a_cuda_graph(monkeypatch):
    """A bfloat16 decode step captured in a CUDA graph with every kernel of ours launched by PDL (an H100 or later)
    writes the same hidden states and cache as without: the kernels wait before any memory access."""
    from demo.build_tiny import build_checkpoint
    from llm import Qwen2LM
    from llm.model import pdl

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9 or more")
    with tempfile.TemporaryDirectory() as d:
        model = Qwen2LM.from_pretrained(build_checkpoint(d, seed=3, init_std=0.5), device="cuda", dtype=torch.bfloat16)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(4)).to("cuda", torch.bfloat16)
    tables = torch.tensor([[1, 3, 7], [2, 7, 7]], dtype=torch.int32, device="cuda")
    static = StaticMeta(torch.tensor([14, 11], device="cuda"), tables, torch.tensor([7, 4], dtype=torch.int32).cuda())
    positions = torch.tensor([[11, 14]], device="cuda").expand(3, -1)
    results = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "enabled", on)
        cache = model.new_cache(8, 4)
        with torch.inference_mode():
            meta = BatchMeta.build([ChunkSpec([1, 3], 0, 6), ChunkSpec([2], 0, 3)], 4, "cuda")
            model(x, torch.arange(9, device="cuda").expand(3, -1) + 5, cache, meta)
            model(x[:2], positions, cache, static)  # warm-up: compiles, and triton_gemm's choices
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = model(x[:2], positions, cache, static)
            for _ in range(3):
                graph.replay()
        torch.cuda.synchronize()
        results[on] = (out.clone(), cache.kv.clone())
    for with_pdl, without in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(with_pdl, without, atol=0, rtol=0, equal_nan=True)
