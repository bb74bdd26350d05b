"""Paged decode attention in place: the Triton kernel against the pure-torch reference (in Triton's interpreter on
CPU, compiled on cuda when there is one, and replayed from a CUDA graph), and the reference against plain SDPA.

NOTE: the interpreter is chosen when triton is imported (triton.language's own jit helpers such as tl.sum are
decorated then), so the interpreter cases run in a child pytest started with TRITON_INTERPRET=1; in this process
they are skipped, and one test runs the child and reports its result.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llm.model import triton_attention
from llm.model.triton_attention import (
    combine_config,
    default_num_splits,
    paged_decode_attention_reference,
    split_config,
)

LENS = [1, 15, 16, 17, 100, 257]  # around block edges (block_size 16), and 17 blocks for the longest
needs_triton = pytest.mark.skipif(triton_attention.triton is None, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
INTERPRETED = triton_attention._INTERPRETED  # this process is the child that runs the kernels on CPU
in_child = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child of test_kernel_cases_pass_in_the_triton_interpreter"
)


def make_batch(
    lens, nh, nkv, hd, dtype, *, block_size=16, pad_rows=0, device="cpu", seed=0, width=None, num_blocks=None
):
    """A paged batch whose block tables are shuffled through the pool, with every slot that no context covers
    (free blocks, the null block 0, the tails of last blocks) set to NaN. pad_rows appends rows as a static batch
    pads: context 1, table all null block."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks_of = [-(-n // block_size) for n in lens]
    width = width or max(num_blocks_of) + 1  # one padding entry at least, pointing at the null block
    num_blocks = num_blocks or 1 + sum(num_blocks_of) + 3  # the null block, the contexts, three free blocks
    k_cache = torch.full((nkv, num_blocks, block_size, hd), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # never block 0
    tables = torch.zeros(len(lens) + pad_rows, width, dtype=torch.int32)
    for row, (n, nb) in enumerate(zip(lens, num_blocks_of)):
        blocks = [pool.pop() for _ in range(nb)]
        tables[row, :nb] = torch.tensor(blocks)
        keys, values = (torch.randn(nkv, n, hd, generator=gen).to(dtype) for _ in range(2))  # (nkv, n, hd)
        for t in range(n):
            k_cache[:, blocks[t // block_size], t % block_size] = keys[:, t]
            v_cache[:, blocks[t // block_size], t % block_size] = values[:, t]
    q = torch.randn(len(lens) + pad_rows, nh, hd, generator=gen).to(dtype)  # (B, nh, hd)
    context_lens = torch.tensor(lens + [1] * pad_rows, dtype=torch.int32)
    return [x.to(device) for x in (q, k_cache, v_cache, tables, context_lens)]


def unpaged_kv(k_cache, v_cache, tables, context_lens, row):
    """One row's keys and values as contiguous (nkv, n, hd), read slot by slot: no shared code with the gather."""
    block_size = k_cache.shape[2]
    slots = [(int(tables[row, t // block_size]), t % block_size) for t in range(int(context_lens[row]))]
    return (torch.stack([c[:, b, s] for b, s in slots], dim=1) for c in (k_cache, v_cache))


def tolerance(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("nh,nkv", [(8, 2), (4, 4)], ids=["gqa", "mha"])
def test_reference_equals_sdpa_on_unpaged_kv(nh, nkv):
    q, k_cache, v_cache, tables, context_lens = make_batch(LENS, nh, nkv, 32, torch.float32)
    out = paged_decode_attention_reference(q, k_cache, v_cache, tables, context_lens, 32**-0.5)
    for row in range(len(LENS)):
        k, v = unpaged_kv(k_cache, v_cache, tables, context_lens, row)  # (nkv, n, hd)
        want = F.scaled_dot_product_attention(q[row][:, None], k, v, enable_gqa=True)  # (nh, 1, hd)
        torch.testing.assert_close(out[row], want[:, 0])


def assert_interpreter_child_passes(test_file: str) -> None:
    """Run test_file's `in_interpreter` tests in a child pytest under TRITON_INTERPRET=1; all must pass, none skip.
    --noconftest: the child needs none of the suite's fixtures (checkpoints, Ray), only that file."""
    if INTERPRETED:
        pytest.skip("this is the child")
    cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "--noconftest"]
    env = dict(os.environ, TRITON_INTERPRET="1")
    child = subprocess.run([*cmd, "-k", "in_interpreter"], env=env, capture_output=True, text=True, timeout=600)
    report = child.stdout[-6000:] + child.stderr[-2000:]
    assert child.returncode == 0, report
    assert " passed" in report and " failed" not in report and " skipped" not in report, report


@needs_triton
@pytest.mark.slow
def test_kernel_cases_pass_in_the_triton_interpreter():
    assert_interpreter_child_passes(__file__)


@in_child
@pytest.mark.parametrize(
    "dtype,nh,nkv,hd,splits",
    [
        (torch.float32, 8, 2, 64, 1),
        (torch.float32, 8, 2, 64, 4),
        (torch.float32, 8, 2, 64, 32),  # more splits than the longest context has blocks (17)
        (torch.bfloat16, 8, 2, 64, 4),
        (torch.bfloat16, 2, 2, 32, 4),
        (torch.float16, 4, 2, 80, 2),  # head_dim not a power of two: padded to 128 and masked
    ],
    ids=["f32-gqa-s1", "f32-gqa-s4", "f32-gqa-s32", "bf16-gqa-s4", "bf16-mha-hd32-s4", "f16-gqa-hd80-s2"],
)
@pytest.mark.parametrize("fold", [True, False], ids=["folded", "combine-kernel"])
def test_kernel_equals_reference_in_interpreter(monkeypatch, dtype, nh, nkv, hd, splits, fold):
    """Folded: the last split to arrive combines (and leaves its counter at zero); else a combine kernel."""
    monkeypatch.setattr(triton_attention, "fold_combine", fold)
    q, k_cache, v_cache, tables, context_lens = make_batch(LENS, nh, nkv, hd, dtype, pad_rows=1)
    args = (q, k_cache, v_cache, tables, context_lens, hd**-0.5)
    out = triton_attention.paged_decode_attention(*args, max_splits=splits)
    want = paged_decode_attention_reference(*args)
    assert out.dtype == dtype and out.shape == q.shape
    real = slice(0, len(LENS))  # the padding row attends to the NaN null block: its output is ignored
    assert out[real].isfinite().all(), "a NaN past some context leaked into a real row"
    torch.testing.assert_close(out[real], want[real], **tolerance(dtype))
    assert not triton_attention._counters[q.device].any(), "a counter left non-zero breaks the next replay"


@in_child
def test_kernel_reads_nothing_past_the_context_in_interpreter():
    """Rows whose contexts end inside a block: rewriting every slot past the contexts leaves the output as it was."""
    q, k_cache, v_cache, tables, context_lens = make_batch([3, 21], 4, 2, 32, torch.float32)
    args = (q, k_cache, v_cache, tables, context_lens, 32**-0.5)
    before = triton_attention.paged_decode_attention(*args, max_splits=2)
    assert before.isfinite().all()
    for cache in (k_cache, v_cache):
        cache.nan_to_num_(nan=1e4)  # huge keys past the context would dominate any softmax that saw them
    torch.testing.assert_close(triton_attention.paged_decode_attention(*args, max_splits=2), before, atol=0, rtol=0)


def test_cpu_tensors_fall_back_to_the_reference():
    if INTERPRETED:
        pytest.skip("the child runs the kernels on CPU")
    q, k_cache, v_cache, tables, context_lens = make_batch([5, 40], 4, 2, 32, torch.float32)
    args = (q, k_cache, v_cache, tables, context_lens, 32**-0.5)
    want = paged_decode_attention_reference(*args)
    torch.testing.assert_close(triton_attention.paged_decode_attention(*args), want)


def test_default_num_splits_depends_on_shapes_only():
    cpu = torch.device("cpu")
    assert default_num_splits(1, 2, 64, cpu) == 4  # 2 programs per "SM" (4 on CPU) over 2 sequence-heads
    assert default_num_splits(1, 2, 2, cpu) == 2  # never more splits than a sequence has blocks
    assert default_num_splits(64, 8, 64, cpu) == 1  # a large batch fills the device without splitting
    assert all(s & (s - 1) == 0 for s in (default_num_splits(b, 2, 100, cpu) for b in range(1, 70)))


TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32", torch.int64: "i64"}


def compile_for_h100(kernel, pointers: dict, constexprs: dict):
    """Compile as a launch on an H100 would (sm_90), down to a cubin with the ptxas bundled with triton; no GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {k: constexprs.pop(k) for k in ("num_warps", "num_stages") if k in constexprs}
    signature = {
        name: ("*" + TYPES[pointers[name]] if name in pointers else "fp32" if name in ("scale", "eps") else "i32")
        for name in kernel.arg_names
        if name not in constexprs
    }
    signature |= {name: "constexpr" for name in constexprs}
    source = ASTSource(kernel, signature, constexprs)
    return triton_attention.triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


@needs_triton
@pytest.mark.parametrize(
    "dtype,group,hd,block_size,splits",
    [(torch.bfloat16, 4, 128, 16, 8), (torch.float32, 8, 128, 16, 8), (torch.float16, 7, 80, 32, 5)],
)
def test_kernels_compile_for_h100_without_spills(dtype, group, hd, block_size, splits):
    """Where no GPU is lent, this still catches a kernel that would not compile for one, and heavy register spills."""
    if INTERPRETED:
        pytest.skip("interpreted kernels do not compile")
    f32, i32 = torch.float32, torch.int32
    pointers = dict(
        q_ptr=dtype,
        k_ptr=dtype,
        v_ptr=dtype,
        block_tables_ptr=i32,
        context_lens_ptr=i32,
        m_ptr=f32,
        l_ptr=f32,
        acc_ptr=f32,
        out_ptr=dtype,
        count_ptr=i32,
    )
    config = split_config(dtype, group, hd, block_size, splits)
    compile_for_h100(triton_attention._split_kernel, pointers, config | dict(FOLD=False, PDL=False))
    split = compile_for_h100(triton_attention._split_kernel, pointers, config | dict(FOLD=True, PDL=True))
    assert "griddepcontrol.wait" in split.asm["ptx"]  # llm/model/pdl.py: the wait before any memory access
    compile_for_h100(triton_attention._combine_kernel, pointers, combine_config(hd, block_size, splits))
    cuobjdump = Path(triton_attention.triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(split.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [cuobjdump, "--dump-resource-usage", cubin.name], capture_output=True, text=True, check=True
        ).stdout
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))  # spilled registers live on the stack
    assert stack <= 16, usage  # a word or two at most; 4 warps spilled hundreds of bytes in float32


@pytest.mark.gpu
@needs_triton
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [None, 1, 4, 32])
def test_compiled_kernel_equals_reference_on_cuda(dtype, splits):
    q, k_cache, v_cache, tables, context_lens = make_batch(LENS, 8, 2, 128, dtype, pad_rows=1, device="cuda")
    args = (q, k_cache, v_cache, tables, context_lens, 128**-0.5)
    out = triton_attention.paged_decode_attention(*args, max_splits=splits)
    want = paged_decode_attention_reference(*args)
    assert out[: len(LENS)].isfinite().all()
    torch.testing.assert_close(out[: len(LENS)], want[: len(LENS)], **tolerance(dtype))


@pytest.mark.gpu
@needs_triton
@needs_cuda
def test_cuda_graph_replay_follows_new_lengths_and_tables():
    """Captured once, replayed after the static buffers were refilled with other lengths, blocks and queries."""
    shapes = dict(device="cuda", width=24, num_blocks=64)  # the static buffers' shapes, both batches
    q, k_cache, v_cache, tables, context_lens = make_batch(LENS, 8, 2, 128, torch.bfloat16, seed=1, **shapes)
    args = (q, k_cache, v_cache, tables, context_lens, 128**-0.5)
    triton_attention.paged_decode_attention(*args, max_splits=8)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_attention.paged_decode_attention(*args, max_splits=8)
    graph.replay()
    torch.testing.assert_close(out, paged_decode_attention_reference(*args), **tolerance(torch.bfloat16))

    second = make_batch([300, 2, 64, 33, 16, 129], 8, 2, 128, torch.bfloat16, seed=2, **shapes)
    for buffer, new in zip(args, second):
        buffer.copy_(new)
    graph.replay()
    torch.testing.assert_close(out, paged_decode_attention_reference(*args), **tolerance(torch.bfloat16))
