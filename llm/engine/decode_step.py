"""The static decode step: a decode-only step over persistent input buffers, padded to a batch bucket, so that on
cuda each bucket's step is captured once as a CUDA graph and replayed (the host then launches one graph instead of
~1,000 kernels). Steps with prefill chunks run eagerly through the same layers (llm/engine/model_runner.py).

Inside the step there is no host sync and no data-dependent shape: the buffers have the bucket's rows, the block
tables a fixed width (ceil(max_model_len / block_size)); padding rows write their key and value into a null block
that the block pool never hands out (the cache's last block) and attend to it alone. The sampler runs outside it.
Attention reads the blocks in place (llm/model/triton_attention.py): the Triton kernel on cuda, its reference elsewhere.
(Buckets, persistent buffers and capture largest-first into one pool follow nano-vllm's and vLLM's model runners.)
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from llm.model.attention import KVCache, StaticMeta

logger = logging.getLogger(__name__)

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def bucket_for(n: int) -> int:
    """The smallest bucket holding n rows: 1, 2, 4, 8, 16, 24, 32, 48, 64, then multiples of 32."""
    assert n >= 1, n
    return next((b for b in _BUCKETS if b >= n), -(-n // 32) * 32)


def buckets_up_to(n: int) -> list[int]:
    """Every bucket a batch of at most n rows can use."""
    top = bucket_for(n)
    return [b for b in _BUCKETS if b <= top] + list(range(96, top + 1, 32))


class StaticDecode:
    """Persistent inputs of decode-only steps, for a model of one device (no tensor parallelism)."""

    def __init__(
        self, model, cache: KVCache, max_num_seqs: int, max_model_len: int, cuda_graphs: bool, compiled: bool = False
    ):
        self.model, self.cache = model, cache
        self.block_size, self.null_block = cache.block_size, cache.num_blocks - 1  # the pool's blocks are the rest
        device = model.lm_head.weight.device
        rows, width = bucket_for(max_num_seqs), -(-max_model_len // self.block_size)
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        # Every row starts as padding: the null block's first slot, one key.
        self.meta = StaticMeta(
            torch.full((rows,), self.null_block * self.block_size, device=device),
            torch.full((rows, width), self.null_block, dtype=torch.int32, device=device),
            torch.ones(rows, dtype=torch.int32, device=device),
        )
        # Host-side staging per buffer (pinned on cuda), filled by the step's Python and copied over once; two sets,
        # used in turn: a step launched ahead (engine.py) fills one while the last step's copies may still be queued.
        pin = device.type == "cuda"
        self._hosts = [
            {name: torch.empty_like(buf, device="cpu", pin_memory=pin) for name, buf in self._buffers()} for _ in "ab"
        ]
        self._np = [{name: t.numpy() for name, t in host.items()} for host in self._hosts]  # the same memory
        self._turn = 0
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.step = self.compile(max_num_seqs) if compiled else self.forward
        if cuda_graphs:
            self.capture(buckets_up_to(max_num_seqs))

    def _buffers(self):
        m = self.meta
        return (
            ("input_ids", self.input_ids),
            ("positions", self.positions),
            ("slots", m.slot_mapping),
            ("tables", m.block_tables),
            ("lens", m.context_lens),
        )

    def forward(self, rows: int) -> torch.Tensor:
        """The step itself on the first `rows` rows of the buffers -> logits (rows, V) float32."""
        m = self.meta
        meta = StaticMeta(m.slot_mapping[:rows], m.block_tables[:rows], m.context_lens[:rows])
        hidden = self.model(
            self.model.embed(self.input_ids[:rows]), self.positions[:rows].expand(3, -1), self.cache, meta
        )  # (rows, D)
        return self.model.logits(hidden)  # (rows, V)

    def prepare(
        self, tokens: list[int] | torch.Tensor, positions: list[int], block_ids: list[list[int]], lengths: list[int]
    ) -> int:
        """Fill the buffers for n sequences (token, its position, its blocks, keys after it); returns the bucket.
        `tokens` on the device, (n,) long, is copied from there (a step launched before the last one's tokens
        reached the host). NOTE: numpy over the host rows, one assignment per buffer (a block table row each): a
        torch.tensor per row cost ~23 us a sequence, most of the host's time between two graph replays at batch 64."""
        n, rows, bs = len(positions), bucket_for(len(positions)), self.block_size
        host, h, self._turn = self._hosts[self._turn], self._np[self._turn], 1 - self._turn
        h["input_ids"][:rows], h["positions"][:rows], h["lens"][:rows] = 0, 0, 1
        h["positions"][:n], h["lens"][:n] = positions, lengths
        if not isinstance(tokens, torch.Tensor):
            h["input_ids"][:n] = tokens
        tables = h["tables"]
        tables[:rows] = self.null_block
        for i, blocks in enumerate(block_ids):
            tables[i, : len(blocks)] = blocks
        last = h["lens"][:n] - 1  # the new token's slot: its block in the table, its offset in the block
        h["slots"][:rows] = self.null_block * bs
        h["slots"][:n] = tables[np.arange(n), last // bs] * bs + last % bs
        for name, buf in self._buffers():
            buf[:rows].copy_(host[name][:rows], non_blocking=True)
        if isinstance(tokens, torch.Tensor):
            self.input_ids[:n].copy_(tokens)  # after the staging's copy, on the same stream
        return rows

    def run(self, n: int, rows: int) -> torch.Tensor:
        """Logits (n, V) of the prepared step: a graph replay where one was captured for the bucket."""
        if rows in self.graphs:
            graph, logits = self.graphs[rows]
            graph.replay()
            return logits[:n]
        return self.step(rows)[:n]

    def compile(self, max_num_seqs: int):
        """`forward` through torch.compile (Inductor: Triton kernels on cuda, C++ on cpu), compiled now on padding
        rows. A step that cannot be compiled runs eagerly, said in the log. Fuses the elementwise ops between the
        GEMMs: RMSNorm, RoPE, SiLU-mul, residual adds. On cpu one graph for every bucket (the rows are symbolic); on
        cuda one per bucket: the attention kernel's grid (its splits) follows the rows, which a symbolic graph would
        guard on bucket by bucket until Dynamo's recompile limit (8) sent the rest back to eager."""
        cuda = self.input_ids.device.type == "cuda"
        buckets = buckets_up_to(max_num_seqs) if cuda else sorted({bucket_for(1), bucket_for(max_num_seqs)})
        if cuda:
            limit = torch._dynamo.config.recompile_limit
            torch._dynamo.config.recompile_limit = max(limit, len(buckets) + 1)
        t0, step = time.monotonic(), torch.compile(self.forward, dynamic=not cuda)
        try:
            with torch.inference_mode():  # as the engine's steps run: the graph Dynamo guards on
                for rows in buckets:
                    step(rows)
        except Exception as e:  # noqa: BLE001 (Dynamo and Inductor raise many kinds; eager still works)
            logger.warning("the decode step could not be compiled, it runs eagerly: %s", e)
            return self.forward
        logger.info("decode step compiled for %d batch buckets in %.1f s", len(buckets), time.monotonic() - t0)
        return step

    def capture(self, buckets: list[int]) -> None:
        """One CUDA graph per bucket, largest first, into one memory pool; a warm-up run of each first (kernels
        compile and allocate outside the capture)."""
        t0, pool = time.monotonic(), None
        for rows in sorted(buckets, reverse=True):
            with torch.inference_mode():  # as the engine's steps run (a compiled step is guarded on it)
                self.step(rows)  # warm-up: the buffers hold padding rows only, which touch the null block alone
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.step(rows)
            pool = graph.pool()
            self.graphs[rows] = (graph, logits)
        logger.info(
            "captured %d decode CUDA graphs (batch buckets %s) in %.1f s", len(buckets), buckets, time.monotonic() - t0
        )


__all__ = ["StaticDecode", "bucket_for", "buckets_up_to"]
