"""Attention over the paged KV cache for a flat batch of chunks (decode steps and prefill chunks mixed).

One-token chunks (decode) attend together in one padded, grouped computation; longer chunks (prefill) attend one
by one through `scaled_dot_product_attention`. The index tensors and masks are built once per step and shared by
every layer.

NOTE: decode attention is written out (two batched matmuls and a float32 softmax) rather than calling
`scaled_dot_product_attention` with a mask: on CPU, torch 2.13's masked SDPA for one query is about 10x slower in
bfloat16 and somewhat slower in float32 (tests/bench/attention.py measures it). The query heads that share a KV
head are one matrix, so the KV is never repeated for GQA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class ChunkSpec:
    block_ids: list[int]
    start: int  # tokens of this sequence already in the cache
    n: int  # tokens in this chunk


@dataclass(slots=True)
class BatchMeta:
    slot_mapping: torch.Tensor  # (T,) cache slot of each token of the batch
    single_idx: torch.Tensor | None  # (B1,) batch index of each one-token chunk (they come first: 0..B1-1)
    single_blocks: torch.Tensor | None  # (B1 * nb,) the blocks of their contexts, padded to nb each
    single_bias: torch.Tensor | None  # (B1, 1, nb * block_size) float32: 0 where a key is real, -inf after
    multi: list[tuple[int, int, int, torch.Tensor | None]]  # (t0, t1, start, context blocks or None if start 0)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # the step's gather buffers, shared by the layers

    @classmethod
    def build(cls, chunks: list[ChunkSpec], block_size: int, device: torch.device) -> BatchMeta:
        """One-token chunks must come first (the engine orders them so): they are built in one go."""
        n_single = next((i for i, c in enumerate(chunks) if c.n != 1), len(chunks))
        assert all(c.n != 1 for c in chunks[n_single:]), "one-token chunks first"
        slot_parts, multi = [], []
        single_idx = single_blocks = single_bias = None
        if n_single:
            singles = chunks[:n_single]
            nb = max(c.start for c in singles) // block_size + 1  # blocks of the longest context
            table = torch.tensor([c.block_ids[:nb] + [0] * (nb - min(nb, len(c.block_ids))) for c in singles])
            starts = torch.tensor([c.start for c in singles])
            own = table.gather(1, (starts // block_size)[:, None]).flatten()  # each token's own block
            slot_parts.append(own * block_size + starts % block_size)
            pos = torch.arange(nb * block_size)
            hidden = pos[None, :] > starts[:, None]  # (B1, S1): keys after each query's own position
            single_bias = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))[:, None, :].to(device)
            single_idx = torch.arange(n_single, device=device)
            single_blocks = table.flatten().to(device)
        t0 = n_single
        for c in chunks[n_single:]:
            blocks = torch.tensor(c.block_ids, dtype=torch.long)
            pos = torch.arange(c.start, c.start + c.n)
            slot_parts.append(blocks[pos // block_size] * block_size + pos % block_size)  # (n,)
            ctx = blocks[: (c.start + c.n - 1) // block_size + 1].to(device) if c.start > 0 else None
            multi.append((t0, t0 + c.n, c.start, ctx))
            t0 += c.n
        return cls(torch.cat(slot_parts).to(device), single_idx, single_blocks, single_bias, multi)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
    """q (T, nh, hd), k/v (T, nkv, hd); caches (nkv, num_blocks, block_size, hd) -> (T, nh, hd)."""
    nkv, hd = k.shape[1], k.shape[2]
    k_cache.view(nkv, -1, hd).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.view(nkv, -1, hd).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    # NOTE: blocks as rows of a 3-D view: index_select copies whole rows, several times faster on CPU than
    # gathering from the 4-D tensor (or token by token).
    kb, vb = k_cache.flatten(2), v_cache.flatten(2)  # (nkv, num_blocks, block_size * hd)
    out = torch.empty_like(q)
    if meta.single_idx is not None:
        B1, g = meta.single_idx.shape[0], q.shape[1] // nkv
        ks = _gather(kb, meta.single_blocks, meta.buffers, "k").view(nkv, B1, -1, hd)  # (nkv, B1, S1, hd)
        vs = _gather(vb, meta.single_blocks, meta.buffers, "v").view(nkv, B1, -1, hd)
        qs = q[:B1].view(B1, nkv, g, hd).transpose(0, 1)  # (nkv, B1, g, hd): a KV head's g query heads as one matrix
        scores = torch.matmul(qs, ks.transpose(-1, -2)).float() * hd**-0.5 + meta.single_bias  # (nkv, B1, g, S1)
        o = torch.matmul(scores.softmax(-1).to(vs.dtype), vs)  # (nkv, B1, g, hd)
        out[:B1] = o.transpose(0, 1).reshape(B1, nkv * g, hd)
    for t0, t1, start, ctx in meta.multi:
        qm = q[t0:t1].transpose(0, 1).unsqueeze(0)  # (1, nh, n, hd)
        n = t1 - t0
        if ctx is None:  # nothing cached before this chunk: plain causal attention over the chunk itself
            km, vm = k[t0:t1].transpose(0, 1), v[t0:t1].transpose(0, 1)  # (nkv, n, hd)
            mask, causal = None, True
        else:  # query i (at position start + i) sees keys 0 .. start + i
            km = kb.index_select(1, ctx).view(nkv, -1, hd)[:, : start + n]  # (nkv, S, hd)
            vm = vb.index_select(1, ctx).view(nkv, -1, hd)[:, : start + n]
            mask = torch.arange(start + n, device=q.device)[None, :] <= torch.arange(start, start + n, device=q.device)[:, None]
            causal = False
        o = F.scaled_dot_product_attention(qm, km.unsqueeze(0), vm.unsqueeze(0), attn_mask=mask, is_causal=causal,
                                           enable_gqa=True)
        out[t0:t1] = o.squeeze(0).transpose(0, 1)  # (n, nh, hd)
    return out


def _gather(rows: torch.Tensor, index: torch.Tensor, buffers: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """rows (nkv, num_blocks, R)[:, index] -> (nkv, len(index), R), into a buffer every layer of the step reuses.

    One index_select over the heads' blocks as rows of a 2-D view: faster on CPU than selecting along dim 1.
    """
    nkv, num_blocks, width = rows.shape
    flat_index = buffers.get("index")
    if flat_index is None:  # the same blocks in every layer and for k and v
        heads = torch.arange(nkv, device=index.device)[:, None] * num_blocks
        flat_index = buffers["index"] = (heads + index[None, :]).flatten()  # (nkv * len(index),)
    buf = buffers.get(name)
    if buf is None or buf.dtype != rows.dtype:
        buf = buffers[name] = torch.empty(flat_index.shape[0], width, dtype=rows.dtype, device=rows.device)
    return torch.index_select(rows.view(-1, width), 0, flat_index, out=buf).view(nkv, -1, width)


__all__ = ["BatchMeta", "ChunkSpec", "paged_attention"]
