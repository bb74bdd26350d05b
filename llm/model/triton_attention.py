"""Paged decode attention that reads the KV blocks in place: a Triton kernel for cuda, and its pure-torch reference.

Design (flash-decoding over a paged cache; GQA grouping as in SGLang's triton_ops/decode_attention.py; the online
softmax as in Triton's fused-attention tutorial):

- One program per (sequence, KV head, split). It loads its KV head's keys once for the whole GQA group of query
  heads (nh / nkv of them, padded to at least 16 rows, the smallest `tl.dot` tile), so GQA costs no repeated
  KV reads. Each key position is looked up through the block table (block = table[t // block_size], slot =
  t % block_size), so the cache is read where it lies: no gather into a contiguous copy.
- Split-KV: a sequence's blocks are cut into at most `num_splits` contiguous ranges of whole blocks, one per
  program, so that a small batch with long contexts still fills the GPU. Each split writes a partial (running
  max, sum of exponentials, unnormalised accumulator) in float32, and the last of a (sequence, KV head)'s splits to
  arrive (an atomic counter that it resets, so a CUDA graph replays it) rescales and sums the splits that were
  written: one kernel, where a combine kernel of its own cost a launch per layer (~2 us in a graph on an H200;
  the split-K fix-up of gemm_kernel.py, CUTLASS's and stream-K's). With one split the program writes the output.
- No value-dependent grid: the grid is (B, nkv, num_splits) whatever the context lengths are, and num_splits comes
  from shapes alone; each program derives its range from context_lens inside the kernel (a short sequence leaves
  its later splits empty: they only count their arrival, and the combine, doing the same arithmetic, skips them).
  So the launch needs no host sync (no max(context_lens)) and is CUDA-graph safe: a replay with other lengths,
  block tables or queries in the same buffers runs the same grid.
- The null block: block-table padding points at block 0, and free blocks may hold anything (NaN included).
  Every position >= context_len is masked in the loads themselves (masked lanes read 0 and never touch memory)
  and its score is set to -inf before the softmax, so nothing past a sequence's context enters the arithmetic.
- Arithmetic in float32: loads are upcast before any math. Triton's interpreter (TRITON_INTERPRET=1, the CPU
  tests) cannot compute in bfloat16 (it multiplies the bit patterns), and on a GPU the upcast costs nothing in
  accuracy: a 16-bit input is exact in tf32, so a tf32 `tl.dot` gives exact products with a float32 sum. A float32
  cache uses ieee dots, so cuda float32 matches CPU float32.

The reference (`paged_decode_attention_reference`) gathers the blocks and runs a masked float32 softmax; it is the
tests' oracle and the fallback where the kernel cannot run (CPU without the interpreter, or triton missing).
"""

from __future__ import annotations

import os

import torch

from llm.model import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch does not bring triton: the reference still works
    triton = None

# NOTE: read once, at the same moment triton.jit reads it to decide whether the kernels below are interpreted.
_INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET", "0") == "1"
_BLOCK_N = 32  # keys per loop step; any block_size works because each key finds its block through the table
fold_combine = True  # off: the combine a kernel of its own (before 2026-12-05), for bench/gpu_decode.py to time
# Arrival counters of the kernels whose last program finishes (these, gemm_kernel.py's), zero after each launch, one
# buffer per device, never reallocated (captured graphs hold it): launches are stream-ordered.
_counters: dict[torch.device, torch.Tensor] = {}
_COUNTERS = 1 << 16


def arrival_counters(device: torch.device) -> torch.Tensor:
    if (counters := _counters.get(device)) is None:
        counters = _counters[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return counters


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _split_kernel(
        q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, count_ptr, scale,
        stride_qb, stride_qh, stride_kh, stride_kb, stride_kt, stride_vh, stride_vb, stride_vt, stride_tb, stride_ob,
        stride_oh, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
        FOLD: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # llm/model/pdl.py: nothing is read or written before the kernel before this one is done
            gdc_wait()
        b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        num_heads = tl.num_programs(1) * GROUP
        context_len = tl.load(context_lens_ptr + b)
        # Splits own whole blocks; the combine repeats this arithmetic to know which splits were written.
        # NOTE: (a + n - 1) // n rather than tl.cdiv: a jit helper call costs milliseconds in the interpreter.
        blocks_per_split = ((context_len + BLOCK_SIZE - 1) // BLOCK_SIZE + NUM_SPLITS - 1) // NUM_SPLITS
        start = split * blocks_per_split * BLOCK_SIZE
        end = tl.minimum(start + blocks_per_split * BLOCK_SIZE, context_len)
        rows = tl.arange(0, GROUP_P2)  # the group's query heads, padded to a dot-sized tile
        heads = kv_head * GROUP + rows
        is_head = rows < GROUP
        dims = tl.arange(0, HEAD_DIM_P2)
        is_dim = dims < HEAD_DIM  # head_dim 80 and the like: padded to a power of two, masked
        is_out = is_head[:, None] & is_dim[None, :]
        part = (b * num_heads + heads) * NUM_SPLITS + split  # (GROUP_P2,) index into (B, nh, NUM_SPLITS)
        out = out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
        l_i = tl.full([GROUP_P2], 0.0, tl.float32)  # tl.full, not tl.zeros: a builtin, no jit call to interpret
        acc = tl.full([GROUP_P2, HEAD_DIM_P2], 0.0, tl.float32)
        if start < end:  # a short context leaves the later splits empty: they write nothing
            q = tl.load(
                q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=is_out, other=0.0
            )  # (GROUP_P2, HEAD_DIM_P2); padding rows are 0: their scores stay finite
            q = (q.to(tl.float32) * scale).to(tl.float32)  # cast again: Inductor passes `scale` as a float64
            k_head = k_ptr + kv_head * stride_kh
            v_head = v_ptr + kv_head * stride_vh
            for t0 in range(start, end, BLOCK_N):
                t = t0 + tl.arange(0, BLOCK_N)
                is_key = t < end
                block = tl.load(block_tables_ptr + b * stride_tb + t // BLOCK_SIZE, mask=is_key, other=0)
                block = block.to(tl.int64)  # block * stride overflows int32 in a cache over 2**31 elements
                slot = t % BLOCK_SIZE
                # Masked loads: lanes past the context (null block, stale or NaN slots) read 0, not the cache.
                kt = tl.load(
                    k_head + block[None, :] * stride_kb + slot[None, :] * stride_kt + dims[:, None],
                    mask=is_dim[:, None] & is_key[None, :],
                    other=0.0,
                )  # (HEAD_DIM_P2, BLOCK_N)
                scores = tl.dot(q, kt.to(tl.float32), input_precision=PRECISION)  # (GROUP_P2, BLOCK_N)
                scores = tl.where(is_key[None, :], scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, 1))  # finite: every step has at least one key
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(scores - m_new[:, None])  # 0 where masked
                v = tl.load(
                    v_head + block[:, None] * stride_vb + slot[:, None] * stride_vt + dims[None, :],
                    mask=is_key[:, None] & is_dim[None, :],
                    other=0.0,
                )  # (BLOCK_N, HEAD_DIM_P2)
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
                l_i = l_i * alpha + tl.sum(p, 1)
                m_i = m_new
        if PDL:
            gdc_launch_dependents()
        if start < end:
            if not FOLD or NUM_SPLITS > 1:
                tl.store(m_ptr + part, m_i, mask=is_head)
                tl.store(l_ptr + part, l_i, mask=is_head)
                tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=is_out)
        if FOLD and NUM_SPLITS == 1:  # the one split is the answer (0 for a context of no keys)
            tl.store(out, (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(out_ptr.dtype.element_ty), is_out)
        elif FOLD:  # the last of the (sequence, KV head)'s splits to arrive combines them, as triton_gemm's split-K
            tl.debug_barrier()  # every thread's partial stored before the one atomic below releases them
            arrived = tl.atomic_add(count_ptr + b * tl.num_programs(1) + kv_head, 1, sem="acq_rel", scope="gpu")
            if arrived == NUM_SPLITS - 1:
                written = ((context_len + BLOCK_SIZE - 1) // BLOCK_SIZE + blocks_per_split - 1) // tl.maximum(
                    blocks_per_split, 1
                )
                m_all = tl.full([GROUP_P2], float("-inf"), tl.float32)  # an online softmax over the splits
                l_all = tl.full([GROUP_P2], 0.0, tl.float32)
                acc_all = tl.full([GROUP_P2, HEAD_DIM_P2], 0.0, tl.float32)
                for s in range(0, written):
                    at = part - split + s
                    m_s = tl.load(m_ptr + at, mask=is_head, other=0.0, cache_modifier=".cg")  # finite: keys > 0
                    m_new = tl.maximum(m_all, m_s)
                    alpha, beta = tl.exp(m_all - m_new), tl.exp(m_s - m_new)
                    l_s = tl.load(l_ptr + at, mask=is_head, other=0.0, cache_modifier=".cg")
                    acc_s = tl.load(acc_ptr + at[:, None] * HEAD_DIM + dims[None, :], mask=is_out, other=0.0,
                                    cache_modifier=".cg")  # fmt: skip
                    acc_all = acc_all * alpha[:, None] + acc_s * beta[:, None]
                    l_all = l_all * alpha + l_s * beta
                    m_all = m_new
                tl.atomic_xchg(count_ptr + b * tl.num_programs(1) + kv_head, 0)  # ready for the next launch or replay
                result = acc_all / tl.where(l_all > 0, l_all, 1.0)[:, None]  # no keys: acc is 0, so is the output
                tl.store(out, result.to(out_ptr.dtype.element_ty), mask=is_out)

    @triton.jit
    def _combine_kernel(
        context_lens_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
        out_ptr,
        stride_ob,
        stride_oh,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_P2: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        SPLITS_P2: tl.constexpr,
    ):
        b, head = tl.program_id(0), tl.program_id(1)
        num_blocks = (tl.load(context_lens_ptr + b) + BLOCK_SIZE - 1) // BLOCK_SIZE
        blocks_per_split = tl.maximum((num_blocks + NUM_SPLITS - 1) // NUM_SPLITS, 1)  # as in _split_kernel
        splits = tl.arange(0, SPLITS_P2)
        is_split = splits < (num_blocks + blocks_per_split - 1) // blocks_per_split  # the splits that were written
        dims = tl.arange(0, HEAD_DIM_P2)
        is_dim = dims < HEAD_DIM
        part = (b * tl.num_programs(1) + head) * NUM_SPLITS + splits  # (SPLITS_P2,)
        m_i = tl.load(m_ptr + part, mask=is_split, other=float("-inf"))
        l_i = tl.load(l_ptr + part, mask=is_split, other=0.0)
        acc = tl.load(
            acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=is_split[:, None] & is_dim[None, :], other=0.0
        )  # (SPLITS_P2, HEAD_DIM_P2)
        # Unwritten splits weigh 0; the where keeps a context of 0 keys (no split written) from -inf - -inf = NaN.
        weight = tl.where(is_split, tl.exp(m_i - tl.max(m_i, 0)), 0.0)
        num = tl.sum(weight[:, None] * acc, 0)  # (HEAD_DIM_P2,)
        den = tl.sum(weight * l_i, 0)
        out = tl.where(den > 0, num / den, 0.0)
        tl.store(out_ptr + b * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=is_dim)


def default_num_splits(batch_size: int, num_kv_heads: int, max_blocks_per_seq: int, device: torch.device) -> int:
    """Splits from shapes alone (never from context lengths), so a CUDA graph per batch bucket keeps its grid.

    Aim for about two programs per streaming multiprocessor, as flash-decoding does to fill the GPU at small
    batch; no more splits than a sequence can have blocks; a power of two, so few kernel variants compile.
    """
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    want = -(-2 * sms // (batch_size * num_kv_heads))
    return max(1, min(_next_power_of_2(want), 16, _next_power_of_2(max_blocks_per_seq)))


def split_config(cache_dtype: torch.dtype, group: int, head_dim: int, block_size: int, num_splits: int) -> dict:
    """_split_kernel's compile-time arguments and launch options (tests compile the same for sm_90 on CPU)."""
    head_dim_p2 = max(16, _next_power_of_2(head_dim))  # tl.dot wants every dimension >= 16
    return dict(
        GROUP=group,
        GROUP_P2=max(16, _next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_p2,
        BLOCK_SIZE=block_size,
        BLOCK_N=_BLOCK_N,
        NUM_SPLITS=num_splits,
        PRECISION="ieee" if cache_dtype == torch.float32 else "tf32",
        # NOTE: from ptxas's register counts for sm_90, not from timings (no GPU yet): with 4 warps a
        # 128-wide head tile takes over 200 registers a thread and spills in float32; with 8 warps no case
        # tried spills more than 8 bytes. Retune on a GPU.
        num_warps=8 if head_dim_p2 >= 128 else 4,
        num_stages=2,
    )


def combine_config(head_dim: int, block_size: int, num_splits: int) -> dict:
    hd_p2, splits_p2 = max(16, _next_power_of_2(head_dim)), _next_power_of_2(num_splits)
    return dict(HEAD_DIM=head_dim, HEAD_DIM_P2=hd_p2, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits, SPLITS_P2=splits_p2)


def _next_power_of_2(n: int) -> int:  # triton.next_power_of_2, for when triton is missing
    return 1 << max(0, n - 1).bit_length()


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, max_splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """One query token per sequence against its paged context.

    q (B, nh, hd); k_cache, v_cache (nkv, num_blocks, block_size, hd); block_tables (B, W) int32, padded with the
    null block 0; context_lens (B,) int32, keys per sequence (>= 1) -> (B, nh, hd) in q's dtype.
    On a non-cuda device (unless the kernels were built under TRITON_INTERPRET=1) this is the reference.
    """
    if triton is None or (q.device.type != "cuda" and not _INTERPRETED):
        return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale, max_splits)
    B, nh, hd = q.shape
    nkv, _, block_size, _ = k_cache.shape
    assert nh % nkv == 0 and k_cache.shape == v_cache.shape and k_cache.shape[-1] == hd, (q.shape, k_cache.shape)
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, "head_dim must be contiguous"
    assert block_tables.dtype == context_lens.dtype == torch.int32, (block_tables.dtype, context_lens.dtype)
    assert block_tables.stride(-1) == 1 and context_lens.is_contiguous()
    num_splits = max_splits or default_num_splits(B, nkv, block_tables.shape[1], q.device)
    assert B * nkv <= _COUNTERS, (B, nkv)
    f32 = dict(device=q.device, dtype=torch.float32)
    # The splits' partials: running max and sum of exponentials (B, nh, S), unnormalised output (B, nh, S, hd).
    m_i, l_i = torch.empty(B, nh, num_splits, **f32), torch.empty(B, nh, num_splits, **f32)
    acc = torch.empty(B, nh, num_splits, hd, **f32)
    out = torch.empty_like(q)  # (B, nh, hd)
    counters = arrival_counters(q.device)
    _split_kernel[(B, nkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, m_i, l_i, acc, out, counters, scale, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        **split_config(k_cache.dtype, nh // nkv, hd, block_size, num_splits), FOLD=fold_combine,
        **pdl.kwargs(q.device),
    )  # fmt: skip
    if not fold_combine:
        _combine_kernel[(B, nh)](
            context_lens, m_i, l_i, acc, out, out.stride(0), out.stride(1), **combine_config(hd, block_size, num_splits)
        )
    return out


def paged_decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, max_splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """The same contract in plain torch: gather each sequence's blocks, masked float32 softmax. max_splits is
    accepted for the common signature and unused."""
    B, nh, hd = q.shape
    nkv, _, block_size, _ = k_cache.shape
    table = block_tables.long()
    S = table.shape[1] * block_size
    is_key = torch.arange(S, device=q.device)[None, :] < context_lens[:, None]  # (B, S)
    # Zero what lies past each context before any arithmetic: the null and free blocks may hold NaN.
    k = k_cache[:, table].flatten(2, 3).transpose(0, 1).float()  # (B, nkv, S, hd)
    v = v_cache[:, table].flatten(2, 3).transpose(0, 1).float()
    k = k.masked_fill(~is_key[:, None, :, None], 0)
    v = v.masked_fill(~is_key[:, None, :, None], 0)
    qg = q.float().view(B, nkv, nh // nkv, hd)  # (B, nkv, g, hd): a KV head's group of query heads
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # (B, nkv, g, S)
    scores = scores.masked_fill(~is_key[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1).masked_fill(~is_key[:, None, None, :], 0)  # a context of 0 keys gives 0, not NaN
    return torch.matmul(probs, v).view(B, nh, hd).to(q.dtype)  # (B, nh, hd)


__all__ = ["default_num_splits", "paged_decode_attention", "paged_decode_attention_reference"]
