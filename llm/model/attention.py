"""The paged KV cache (`KVCache`: one pool of fixed-size blocks per layer, allocated once at start-up) and attention
over it for a flat batch of chunks (decode steps and prefill chunks mixed).

One-token chunks (decode) attend together in one padded, grouped computation; longer chunks (prefill) attend one
by one through `scaled_dot_product_attention`. The index tensors and masks are built once per step and shared by
every layer.

NOTE: decode attention is written out (two batched matmuls and a float32 softmax) rather than calling
`scaled_dot_product_attention` with a mask: on CPU, torch 2.13's masked SDPA for one query is about 4x slower in
bfloat16 and a little slower in float32 (`make bench-kernels` measures it). The query heads that share a KV head
are one matrix, so the KV is never repeated for GQA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llm.model import cpu_kernels, hugepages
from llm.model.cpu_kernels import paged_decode_cpu
from llm.model.triton_attention import paged_decode_attention


@dataclass(slots=True)
class KVCache:
    # Head-major: a gather of blocks along dim 2 gives each KV head's keys as one contiguous (tokens, hd) matrix
    # per sequence, the layout the attention matmuls want (llm/model/attention.py). Keys and values of a layer share one
    # tensor (keys of the nkv heads, then their values), so a step writes both, and gathers both, in one op.
    kv: torch.Tensor  # (L, 2 * nkv, num_blocks, block_size, hd)

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> KVCache:
        shape = (num_layers, 2 * num_kv_heads, num_blocks, block_size, head_dim)
        if torch.device(device).type == "cpu":  # blocks are read in place, scattered: huge pages (hugepages.py)
            return cls(hugepages.zeros(shape, dtype))
        return cls(torch.zeros(shape, device=device, dtype=dtype))

    @property
    def k(self) -> torch.Tensor:
        return self.kv[:, : self.kv.shape[1] // 2]  # (L, nkv, num_blocks, block_size, hd)

    @property
    def v(self) -> torch.Tensor:
        return self.kv[:, self.kv.shape[1] // 2 :]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[2]

    @property
    def block_size(self) -> int:
        return self.kv.shape[3]

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


def num_kv_blocks(
    bytes_per_token: int,
    *,
    block_size: int,
    max_model_len: int,
    device: torch.device,
    kv_cache_tokens: int | None,
    gpu_memory_utilization: float,
    cpu_kv_cache_gib: float,
) -> int:
    """Blocks for the configured budget; it must hold at least one sequence of max_model_len."""
    if kv_cache_tokens is not None:
        tokens = kv_cache_tokens
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * gpu_memory_utilization - (total - free)  # what this process and others already hold
        tokens = int(budget // bytes_per_token)
    else:
        tokens = int(cpu_kv_cache_gib * (1 << 30) // bytes_per_token)
    if tokens < max_model_len:
        raise ValueError(
            f"the KV cache holds {tokens} tokens, fewer than max_model_len={max_model_len}: "
            "raise the cache budget or lower max_model_len"
        )
    return tokens // block_size


@dataclass(slots=True)
class ChunkSpec:
    block_ids: list[int]
    start: int  # tokens of this sequence already in the cache
    n: int  # tokens in this chunk


@dataclass(slots=True)
class DecodeGroup:
    """One-token chunks i0..i1-1 of the batch whose contexts are padded to the same number of blocks."""

    i0: int
    i1: int
    blocks: torch.Tensor  # ((i1 - i0) * nb,) the blocks of their contexts, padded to nb each
    bias: torch.Tensor  # (i1 - i0, 1, nb * block_size) float32: 0 where a key is real, -inf after


@dataclass(slots=True)
class BatchMeta:
    slot_mapping: torch.Tensor  # (T,) cache slot of each token of the batch
    decode: list[DecodeGroup]  # the one-token chunks (rows 0..B1-1), in groups of similar context length
    multi: list[tuple[int, int, int, torch.Tensor | None]]  # (t0, t1, start, context blocks or None if start 0)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # the step's gather buffers, shared by the layers
    chunks: list[ChunkSpec] = field(default_factory=list)  # what it was built from (other tensor-parallel ranks
    block_size: int = 0  # build their own from these: llm/model/parallel.py)
    # On CPU with llm/model/cpu_kernels.py built: the one-token chunks' block tables (B1, W) int32 and key counts (B1,)
    # int32, read in place (then `decode` is empty).
    decode_tables: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, chunks: list[ChunkSpec], block_size: int, device: torch.device) -> BatchMeta:
        """One-token chunks must come first (the engine orders them so, shortest context first)."""
        n_single = next((i for i, c in enumerate(chunks) if c.n != 1), len(chunks))
        assert all(c.n != 1 for c in chunks[n_single:]), "one-token chunks first"
        slot_parts, multi, decode, tables = [], [], [], None
        if n_single and device.type == "cpu" and cpu_kernels.available():
            single = chunks[:n_single]
            width = max(c.start // block_size + 1 for c in single)
            table = torch.tensor(
                [c.block_ids[:width] + [0] * (width - min(width, len(c.block_ids))) for c in single], dtype=torch.int32
            )  # (B1, W)
            # each token's slot in its own block, and each row's keys; in Python: a few ints, where torch's ops on
            # them cost ~10 us each
            slot_parts.append(
                torch.tensor([c.block_ids[c.start // block_size] * block_size + c.start % block_size for c in single])
            )
            tables = (table, torch.tensor([c.start + 1 for c in single], dtype=torch.int32))
        groups = [] if tables is not None else decode_groups([c.start // block_size + 1 for c in chunks[:n_single]])
        for i0, i1 in groups:
            group = chunks[i0:i1]
            nb = max(c.start for c in group) // block_size + 1  # blocks of the longest context
            table = torch.tensor([c.block_ids[:nb] + [0] * (nb - min(nb, len(c.block_ids))) for c in group])
            starts = torch.tensor([c.start for c in group])
            own = table.gather(1, (starts // block_size)[:, None]).flatten()  # each token's own block
            slot_parts.append(own * block_size + starts % block_size)
            hidden = torch.arange(nb * block_size)[None, :] > starts[:, None]  # (n, S): keys after the query
            bias = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))[:, None, :]
            decode.append(DecodeGroup(i0, i1, table.flatten().to(device), bias.to(device)))
        t0 = n_single
        for c in chunks[n_single:]:
            blocks = torch.tensor(c.block_ids, dtype=torch.long)
            pos = torch.arange(c.start, c.start + c.n)
            slot_parts.append(blocks[pos // block_size] * block_size + pos % block_size)  # (n,)
            ctx = blocks[: (c.start + c.n - 1) // block_size + 1].to(device) if c.start > 0 else None
            multi.append((t0, t0 + c.n, c.start, ctx))
            t0 += c.n
        return cls(
            torch.cat(slot_parts).to(device), decode, multi, chunks=chunks, block_size=block_size, decode_tables=tables
        )


@dataclass(slots=True)
class StaticMeta:
    """A static decode step's attention inputs (engine/decode_step.py): persistent buffers of a fixed batch bucket, so a
    captured CUDA graph replays them. Padding rows write to, and read only, the null block."""

    slot_mapping: torch.Tensor  # (B,) cache slot of each row's new token
    block_tables: torch.Tensor  # (B, W) int32, W = ceil(max_model_len / block_size), padded with the null block
    context_lens: torch.Tensor  # (B,) int32: keys of each row, its new token included


def decode_groups(num_blocks: list[int], slack: float = 0.3, min_slack: int = 8) -> list[tuple[int, int]]:
    """Split sequences into contiguous runs [i0, i1) whose context lengths (in blocks) differ by at most `slack` of
    the run's longest, or `min_slack` blocks. Each run is padded to its longest, so with lengths sorted (the engine
    sorts them) a gather wastes at most ~30%, where one run padded to the batch's longest wasted ~40% on the
    decode-heavy benchmark's batches; the floor keeps short contexts from splitting into many tiny runs."""
    groups, i1 = [], len(num_blocks)
    while i1 > 0:
        i0, hi, lo = i1 - 1, num_blocks[i1 - 1], num_blocks[i1 - 1]
        while i0 > 0:
            h, lw = max(hi, num_blocks[i0 - 1]), min(lo, num_blocks[i0 - 1])
            if h - lw > max(slack * h, min_slack):
                break
            i0, hi, lo = i0 - 1, h, lw
        groups.append((i0, i1))
        i1 = i0
    return groups[::-1]


def write_kv(kv_cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """kv (T, 2 * nkv, hd) into kv_cache (2 * nkv, num_blocks, block_size, hd) at the flat slots (T,), in place."""
    two_nkv, hd = kv.shape[1], kv.shape[2]
    kv_cache.view(two_nkv, -1, hd).index_copy_(1, slots, kv.transpose(0, 1))


# The same write as an op of its own, for torch.compile (llm.compile_decode): written as index_copy_ on a view of the
# cache inside the graph, it was functionalized into a copy of each layer's cache and a copy of the whole cache back at
# the end of every step (Inductor's `fused_copy__view` kernels, ~0.5 ms a step on an H200); a custom op that declares
# the mutation is written in place. Eager steps call `write_kv` itself: the op's dispatch costs ~25 us a call on CPU.
kv_write = torch.library.custom_op("llm::kv_write", write_kv, mutates_args=("kv_cache",))


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: BatchMeta | StaticMeta,
    scale: float,
    written: bool = False,
) -> torch.Tensor:
    """q (T, nh, hd); kv (T, 2 * nkv, hd): the new tokens' keys then values; kv_cache (2 * nkv, num_blocks,
    block_size, hd): keys of the nkv heads, then their values -> (T, nh, hd). The new keys and values go into the
    cache in one write (unless `written`: the caller's kernel did it); a step's gathers read keys and values of all
    heads in one index_select."""
    two_nkv, hd = kv.shape[1], kv.shape[2]
    nkv = two_nkv // 2
    if not written:
        write = kv_write if torch.compiler.is_compiling() else write_kv  # in place either way (see kv_write)
        write(kv_cache, meta.slot_mapping, kv)
    if isinstance(meta, StaticMeta):  # the blocks read in place (Triton on cuda), a static shape for CUDA graphs
        return paged_decode_attention(q, kv_cache[:nkv], kv_cache[nkv:], meta.block_tables, meta.context_lens, scale)
    # NOTE: blocks as rows of a 3-D view: index_select copies whole rows, several times faster on CPU than
    # gathering from the 4-D tensor (or token by token).
    rows = kv_cache.flatten(2)  # (2 * nkv, num_blocks, block_size * hd)
    out = None
    if meta.decode_tables is not None:  # CPU: the decode rows read their blocks in place
        n_single = meta.decode_tables[1].shape[0]
        dec = paged_decode_cpu(q[:n_single], kv_cache, *meta.decode_tables, scale)  # (B1, nh, hd)
        if not meta.multi:
            return dec
        out = torch.empty_like(q)
        out[:n_single] = dec
    single = len(meta.decode) == 1 and meta.decode[0].i1 - meta.decode[0].i0 == q.shape[0]
    for gi, group in enumerate(meta.decode):
        n, g = group.i1 - group.i0, q.shape[1] // nkv
        kvs = _gather(rows, group.blocks, meta.buffers, f"kv{gi}").view(two_nkv, n, -1, hd)  # (2nkv, n, S, hd)
        ks, vs = kvs[:nkv], kvs[nkv:]
        qs = q[group.i0 : group.i1].view(n, nkv, g, hd).transpose(0, 1)  # (nkv, n, g, hd): a KV head's g query heads
        scores = torch.matmul(qs, ks.transpose(-1, -2))  # (nkv, n, g, S)
        if scale != 1.0:
            scores = scores * scale
        probs = (
            torch.softmax(scores.add_(group.bias), -1)
            if scores.dtype == torch.float32
            else torch.softmax(scores.float().add_(group.bias), -1).to(vs.dtype)
        )
        o = torch.matmul(probs, vs).transpose(0, 1)  # (n, nkv, g, hd)
        if single:
            return o.reshape(n, nkv * g, hd)
        if out is None:
            out = torch.empty_like(q)
        out[group.i0 : group.i1] = o.reshape(n, nkv * g, hd)
    if out is None:
        out = torch.empty_like(q)
    for t0, t1, start, ctx in meta.multi:
        qm = q[t0:t1].transpose(0, 1).unsqueeze(0)  # (1, nh, n, hd)
        n = t1 - t0
        if ctx is None:  # nothing cached before this chunk: plain causal attention over the chunk itself
            km, vm = kv[t0:t1, :nkv].transpose(0, 1), kv[t0:t1, nkv:].transpose(0, 1)  # (nkv, n, hd)
            mask, causal = None, True
        else:  # query i (at position start + i) sees keys 0 .. start + i
            kvm = rows.index_select(1, ctx).view(two_nkv, -1, hd)[:, : start + n]  # (2nkv, S, hd)
            km, vm = kvm[:nkv], kvm[nkv:]
            keys, queries = torch.arange(start + n, device=q.device), torch.arange(start, start + n, device=q.device)
            mask = keys[None, :] <= queries[:, None]
            causal = False
        o = F.scaled_dot_product_attention(
            qm, km.unsqueeze(0), vm.unsqueeze(0), attn_mask=mask, is_causal=causal, enable_gqa=True, scale=scale
        )
        out[t0:t1] = o.squeeze(0).transpose(0, 1)  # (n, nh, hd)
    return out


def _gather(rows: torch.Tensor, index: torch.Tensor, buffers: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """rows (H, num_blocks, R)[:, index] -> (H, len(index), R), into a buffer every layer of the step reuses.

    One index_select over the heads' blocks as rows of a 2-D view: faster on CPU than selecting along dim 1.
    """
    heads, num_blocks, width = rows.shape
    buf = buffers.get(name)
    if buf is None:  # the first layer of the step: the flat index and the buffer, for all layers
        offsets = torch.arange(heads, device=index.device)[:, None] * num_blocks
        buffers[name + ".index"] = (offsets + index[None, :]).flatten()  # (heads * len(index),)
        buf = buffers[name] = torch.empty(heads * index.shape[0], width, dtype=rows.dtype, device=rows.device)
    return torch.index_select(rows.view(-1, width), 0, buffers[name + ".index"], out=buf).view(heads, -1, width)


__all__ = [
    "BatchMeta",
    "ChunkSpec",
    "DecodeGroup",
    "KVCache",
    "StaticMeta",
    "decode_groups",
    "num_kv_blocks",
    "paged_attention",
]
