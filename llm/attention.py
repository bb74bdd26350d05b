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
    single_idx: torch.Tensor | None  # (B1,) batch index of each one-token chunk
    single_slots: torch.Tensor | None  # (B1, S1) cache slots of their contexts, padded
    single_mask: torch.Tensor | None  # (B1, 1, 1, S1) True where a key is real
    multi: list[tuple[int, int, int, torch.Tensor | None]]  # (t0, t1, start, context slots or None if start 0)

    @classmethod
    def build(cls, chunks: list[ChunkSpec], block_size: int, device: torch.device) -> BatchMeta:
        slot_parts, singles, multi, t0 = [], [], [], 0
        for c in chunks:
            blocks = torch.tensor(c.block_ids, dtype=torch.long)
            pos = torch.arange(c.start + c.n)
            slots = blocks[pos // block_size] * block_size + pos % block_size  # (start + n,)
            slot_parts.append(slots[c.start :])
            if c.n == 1:
                singles.append((t0, slots))
            else:
                multi.append((t0, t0 + c.n, c.start, slots.to(device) if c.start > 0 else None))
            t0 += c.n
        single_idx = single_slots = single_mask = None
        if singles:
            width = max(len(s) for _, s in singles)
            single_slots = torch.zeros(len(singles), width, dtype=torch.long)
            single_mask = torch.zeros(len(singles), width, dtype=torch.bool)
            for i, (_, s) in enumerate(singles):
                single_slots[i, : len(s)], single_mask[i, : len(s)] = s, True
            single_idx = torch.tensor([t for t, _ in singles], device=device)
            single_slots, single_mask = single_slots.to(device), single_mask[:, None, None, :].to(device)
        return cls(torch.cat(slot_parts).to(device), single_idx, single_slots, single_mask, multi)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
    """q (T, nh, hd), k/v (T, nkv, hd); caches (num_blocks, block_size, nkv, hd) -> (T, nh, hd)."""
    nkv, hd = k.shape[1], k.shape[2]
    kc, vc = k_cache.view(-1, nkv, hd), v_cache.view(-1, nkv, hd)  # (slots, nkv, hd)
    kc.index_copy_(0, meta.slot_mapping, k)
    vc.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    if meta.single_idx is not None:
        qs = q[meta.single_idx].unsqueeze(2)  # (B1, nh, 1, hd)
        ks = kc[meta.single_slots].transpose(1, 2)  # (B1, nkv, S1, hd)
        vs = vc[meta.single_slots].transpose(1, 2)  # (B1, nkv, S1, hd)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=meta.single_mask, enable_gqa=True)
        out[meta.single_idx] = o.squeeze(2)  # (B1, nh, hd)
    for t0, t1, start, ctx in meta.multi:
        qm = q[t0:t1].transpose(0, 1).unsqueeze(0)  # (1, nh, n, hd)
        if ctx is None:  # nothing cached before this chunk: plain causal attention over the chunk itself
            km, vm, mask, causal = k[t0:t1], v[t0:t1], None, True
        else:  # query i (at position start + i) sees keys 0 .. start + i
            km, vm, causal = kc[ctx], vc[ctx], False
            n, s = t1 - t0, ctx.shape[0]
            mask = torch.arange(s, device=q.device)[None, :] <= torch.arange(start, start + n, device=q.device)[:, None]
        km, vm = km.transpose(0, 1).unsqueeze(0), vm.transpose(0, 1).unsqueeze(0)  # (1, nkv, S, hd)
        o = F.scaled_dot_product_attention(qm, km, vm, attn_mask=mask, is_causal=causal, enable_gqa=True)
        out[t0:t1] = o.squeeze(0).transpose(0, 1)  # (n, nh, hd)
    return out


__all__ = ["BatchMeta", "ChunkSpec", "paged_attention"]
