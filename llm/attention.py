"""Attention over the paged KV cache for a flat batch of chunks (decode steps and prefill chunks mixed).

One-token chunks (decode) attend together in one padded call; longer chunks (prefill) attend one by one.
The index tensors are built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    single_mask: torch.Tensor | None  # (B1, 1, 1, nb * block_size) True where a key is real
    multi: list[tuple[int, int, int, torch.Tensor | None]]  # (t0, t1, start, context blocks or None if start 0)

    @classmethod
    def build(cls, chunks: list[ChunkSpec], block_size: int, device: torch.device) -> BatchMeta:
        """One-token chunks must come first (the engine orders them so): they are built in one go."""
        n_single = next((i for i, c in enumerate(chunks) if c.n != 1), len(chunks))
        assert all(c.n != 1 for c in chunks[n_single:]), "one-token chunks first"
        slot_parts, multi = [], []
        single_idx = single_blocks = single_mask = None
        if n_single:
            singles = chunks[:n_single]
            nb = max(c.start for c in singles) // block_size + 1  # blocks of the longest context
            table = torch.tensor([c.block_ids[:nb] + [0] * (nb - min(nb, len(c.block_ids))) for c in singles])
            starts = torch.tensor([c.start for c in singles])
            own = table.gather(1, (starts // block_size)[:, None]).flatten()  # each token's own block
            slot_parts.append(own * block_size + starts % block_size)
            pos = torch.arange(nb * block_size)
            single_mask = (pos[None, :] <= starts[:, None])[:, None, None, :].to(device)  # (B1, 1, 1, S1)
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
        return cls(torch.cat(slot_parts).to(device), single_idx, single_blocks, single_mask, multi)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
    """q (T, nh, hd), k/v (T, nkv, hd); caches (num_blocks, block_size, nkv, hd) -> (T, nh, hd)."""
    nkv, hd = k.shape[1], k.shape[2]
    k_cache.view(-1, nkv, hd).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, nkv, hd).index_copy_(0, meta.slot_mapping, v)
    # NOTE: blocks as rows of a 2-D view: index_select copies whole rows, several times faster on CPU than
    # gathering from the 4-D tensor (or token by token).
    kb, vb = k_cache.view(k_cache.shape[0], -1), v_cache.view(v_cache.shape[0], -1)  # (num_blocks, bs*nkv*hd)
    out = torch.empty_like(q)
    if meta.single_idx is not None:
        B1 = meta.single_idx.shape[0]
        qs = q[:B1].unsqueeze(2)  # (B1, nh, 1, hd)
        ks = kb.index_select(0, meta.single_blocks).view(B1, -1, nkv, hd).transpose(1, 2)  # (B1, nkv, S1, hd)
        vs = vb.index_select(0, meta.single_blocks).view(B1, -1, nkv, hd).transpose(1, 2)  # (B1, nkv, S1, hd)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=meta.single_mask, enable_gqa=True)
        out[:B1] = o.squeeze(2)  # (B1, nh, hd)
    for t0, t1, start, ctx in meta.multi:
        qm = q[t0:t1].transpose(0, 1).unsqueeze(0)  # (1, nh, n, hd)
        n = t1 - t0
        if ctx is None:  # nothing cached before this chunk: plain causal attention over the chunk itself
            km, vm, mask, causal = k[t0:t1], v[t0:t1], None, True
        else:  # query i (at position start + i) sees keys 0 .. start + i
            km = kb.index_select(0, ctx).view(-1, nkv, hd)[: start + n]  # (S, nkv, hd)
            vm = vb.index_select(0, ctx).view(-1, nkv, hd)[: start + n]
            mask = torch.arange(start + n, device=q.device)[None, :] <= torch.arange(start, start + n, device=q.device)[:, None]
            causal = False
        km, vm = km.transpose(0, 1).unsqueeze(0), vm.transpose(0, 1).unsqueeze(0)  # (1, nkv, S, hd)
        o = F.scaled_dot_product_attention(qm, km, vm, attn_mask=mask, is_causal=causal, enable_gqa=True)
        out[t0:t1] = o.squeeze(0).transpose(0, 1)  # (n, nh, hd)
    return out


__all__ = ["BatchMeta", "ChunkSpec", "paged_attention"]
