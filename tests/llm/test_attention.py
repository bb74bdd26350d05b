"""Paged attention against plain causal attention over each sequence's own keys, for decode batches split into
length groups, prefill chunks and both mixed; and the grouping rule itself."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from llm.model import BatchMeta, ChunkSpec, cpu_kernels, paged_attention
from llm.model.attention import decode_groups

NKV, GROUP, BS = 2, 3, 4  # 6 query heads on 2 KV heads


def _reference(q_seq, k_seq, v_seq, start):
    """Queries at positions start.. of one sequence, keys 0 .. start + n - 1: causal attention, GQA repeated."""
    n, S = q_seq.shape[0], k_seq.shape[0]
    mask = torch.arange(S)[None, :] <= torch.arange(start, start + n)[:, None]
    k, v = (t.repeat_interleave(GROUP, dim=1).transpose(0, 1) for t in (k_seq, v_seq))  # (nh, S, hd)
    return F.scaled_dot_product_attention(q_seq.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)


@pytest.fixture(params=["in-place kernel", "in-place kernel, shared", "gather"])
def decode_path(request, monkeypatch):
    """Decode rows through llm/model/cpu_kernels.py's kernel (built here if need be), alone or sharing its tasks with
    the helper thread, or the gather it replaces."""
    assert cpu_kernels.load() is not None, "the CPU kernel must build here (C++ compiler and ninja)"
    cpu_kernels.use_helper(request.param.endswith("shared"))
    if request.param == "gather":
        monkeypatch.setattr(cpu_kernels, "_module", None)
    yield request.param.removesuffix(", shared")
    monkeypatch.undo()
    cpu_kernels.use_helper(False)


@pytest.mark.parametrize("HD", [8, 64, 12])  # one 8-wide chunk, eight (a real head), not a multiple of 8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_decode_and_prefill_equal_per_sequence_attention(dtype, HD, decode_path):
    rng = random.Random(0)
    torch.manual_seed(0)
    # Decode contexts from 1 to 300 tokens (several length groups), sorted as the engine sorts them; then prefill
    # chunks with and without cached context.
    decode_lens = sorted(rng.randint(1, 300) for _ in range(12))
    prefill = [(0, 7), (33, 5), (120, 16)]  # (cached tokens, new tokens)
    assert len(decode_groups([s // BS + 1 for s in decode_lens])) > 1
    lengths = [s + 1 for s in decode_lens] + [a + n for a, n in prefill]
    num_blocks = sum(-(-n // BS) for n in lengths) + 4
    kv_cache = torch.zeros(2 * NKV, num_blocks, BS, HD, dtype=dtype)  # keys of the NKV heads, then their values
    k_cache, v_cache = kv_cache[:NKV], kv_cache[NKV:]
    free = list(range(num_blocks))
    rng.shuffle(free)  # blocks scattered through the pool
    full_k = [torch.randn(n, NKV, HD, dtype=dtype) for n in lengths]
    full_v = [torch.randn(n, NKV, HD, dtype=dtype) for n in lengths]
    chunks, q_rows, new_k, new_v = [], [], [], []
    for i, (n, (start, new)) in enumerate(zip(lengths, [(s, 1) for s in decode_lens] + prefill, strict=True)):
        blocks = [free.pop() for _ in range(-(-n // BS))]
        for t in range(start):  # what earlier steps cached
            k_cache[:, blocks[t // BS], t % BS] = full_k[i][t]
            v_cache[:, blocks[t // BS], t % BS] = full_v[i][t]
        chunks.append(ChunkSpec(blocks, start, new))
        q_rows.append(torch.randn(new, NKV * GROUP, HD, dtype=dtype))
        new_k.append(full_k[i][start:])
        new_v.append(full_v[i][start:])
    meta = BatchMeta.build(chunks, BS, torch.device("cpu"))
    assert (meta.decode_tables is not None) == (decode_path == "in-place kernel")
    kv = torch.cat([torch.cat(new_k), torch.cat(new_v)], dim=1)  # (T, 2 * NKV, HD)
    out = paged_attention(torch.cat(q_rows), kv, kv_cache, meta, scale=HD**-0.5)
    row, tol = 0, 1e-5 if dtype == torch.float32 else 2e-2
    for i, c in enumerate(chunks):
        expected = _reference(q_rows[i].float(), full_k[i].float(), full_v[i].float(), c.start)
        torch.testing.assert_close(out[row : row + c.n].float(), expected, atol=tol, rtol=tol)
        row += c.n


def test_groups_are_contiguous_runs_with_bounded_padding():
    lengths = [1, 2, 3, 9, 10, 30, 31, 40, 100, 120, 128]
    groups = decode_groups(lengths)
    assert groups[0][0] == 0 and groups[-1][1] == len(lengths)
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))  # contiguous, in order, covering all
    for i0, i1 in groups:
        run = lengths[i0:i1]
        assert max(run) - min(run) <= max(0.3 * max(run), 8)
    assert decode_groups([5] * 64) == [(0, 64)]  # equal lengths: one run
    assert decode_groups([]) == []
