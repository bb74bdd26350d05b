"""Tensor parallelism inside one LLM replica: which slice of each weight a rank holds, and the per-step protocol.

Megatron-LM's split (Shoeybi et al., 2019): q/k/v and gate/up are split by output rows (whole heads, a share of
the MLP), o_proj and down_proj by input columns, each followed by one all-reduce, so every block half costs one
all-reduce of (T, D). The KV cache follows the heads. `lm_head` is split by vocabulary rows; rank 0 gathers the
logits of the rows it samples. Only rank 0 holds the embedding table: it embeds, merges the images, and broadcasts
the step's `inputs_embeds`, so every rank enters the first layer with identical inputs.

Rank 0 runs the engine; the other ranks run `serve_rank`, which follows rank 0's broadcasts. Torch's process group
does the talking (gloo on CPU, NCCL on GPU); who starts the processes is the caller's business (Ray, in
deployments/llm/tp.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from llm.model import cpu_kernels
from llm.model.attention import BatchMeta

# (parameter name pattern, dim split across ranks); names not listed are whole on every rank.
_SPLITS: tuple[tuple[re.Pattern, int], ...] = (
    (re.compile(r"layers\.\d+\.self_attn\.[qkv]_proj\.(weight|bias)$"), 0),
    (re.compile(r"layers\.\d+\.mlp\.(gate|up)_proj\.(weight|bias)$"), 0),
    (re.compile(r"layers\.\d+\.self_attn\.o_proj\.weight$"), 1),
    (re.compile(r"layers\.\d+\.mlp\.down_proj\.weight$"), 1),
    (re.compile(r"lm_head\.weight$"), 0),
)


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This process's place among the ranks of one replica; world_size 1 is plain single-device inference."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.world_size, (self.rank, self.world_size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def index(self, name: str, shape: tuple[int, ...]) -> tuple[slice, ...]:
        """This rank's slice of parameter `name` (of the whole `shape`): whole unless the name is split."""
        dim = next((d for pattern, d in _SPLITS if pattern.search(name)), None) if self.world_size > 1 else None
        if dim is None:
            return (slice(None),)
        per_rank = -(-shape[dim] // self.world_size)  # the vocabulary may not divide: the last slice is short
        start = min(self.rank * per_rank, shape[dim])
        return (slice(None),) * dim + (slice(start, min(start + per_rank, shape[dim])),)

    def rows(self, n: int) -> int:
        """Rows of an n-row split parameter on each rank (the short last slice is padded to this)."""
        return -(-n // self.world_size)


def check_divisible(num_heads: int, num_kv_heads: int, intermediate_size: int, world_size: int) -> None:
    """Heads and the MLP must split evenly; say which one does not."""
    for what, n in (("attention heads", num_heads), ("KV heads", num_kv_heads), ("MLP size", intermediate_size)):
        if n % world_size:
            raise ValueError(f"tensor_parallel_size={world_size} does not divide the model's {n} {what}")


def init_process_group(rank: int, world_size: int, init_method: str, device: torch.device, timeout_s: float) -> None:
    """Join the replica's ranks. A collective that waits longer than `timeout_s` raises (gloo) or aborts (NCCL)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def _broadcast(obj: object) -> object:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class RankFailure(RuntimeError):
    """A step of the ranks failed (a rank died, hung, or raised): they are out of step for good."""


def _abort() -> None:
    """Leave the group, which closes its connections: the other ranks' pending collectives fail at once instead
    of waiting out the timeout."""
    try:
        dist.destroy_process_group()
    except Exception:  # already gone
        pass


def _collective(fn):
    """Rank 0 runs a step's part; any failure in it, a collective's or a local one, leaves the ranks out of step."""
    try:
        return fn()
    except Exception as e:  # gloo: a peer's socket closed, or the timeout passed; or e.g. out of memory here
        _abort()
        raise RankFailure(f"tensor-parallel step failed: {e}") from e


class ParallelLM:
    """Rank 0's view of a tensor-parallel model: the engine calls it like `Qwen2LM`; each call first tells the
    other ranks what to run."""

    def __init__(self, local):
        assert local.tp.rank == 0 and dist.is_initialized(), "rank 0 drives the others"
        self.local = local
        self.config, self.lm_head = local.config, local.lm_head

    def new_cache(self, num_blocks: int, block_size: int):
        self._send(("cache", num_blocks, block_size))
        return self.local.new_cache(num_blocks, block_size)

    def kv_bytes_per_token(self) -> int:
        return self.local.kv_bytes_per_token()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.local.embed(input_ids)

    def __call__(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, cache, meta: BatchMeta, deepstack=None
    ) -> torch.Tensor:
        """`deepstack` (Qwen3-VL's image rows of this step, as Qwen2LM.forward takes it) goes to every rank: each
        holds the whole hidden state, so each adds the same features."""
        stack = None if deepstack is None else (tuple(deepstack[1].shape), deepstack[1].dtype)
        self._send(("forward", meta.chunks, meta.block_size, positions.cpu(), inputs_embeds.shape[0], stack))
        _collective(lambda: dist.broadcast(inputs_embeds.contiguous(), src=0))
        if deepstack is not None:
            _collective(lambda: dist.broadcast(deepstack[0].contiguous(), src=0))
            _collective(lambda: dist.broadcast(deepstack[1].contiguous(), src=0))
        return _collective(lambda: self.local(inputs_embeds, positions, cache, meta, deepstack))  # (T, D)

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        self._send(("logits", rows))
        return _collective(lambda: gather_logits(self.local, hidden[rows], self.local.config.vocab_size))  # (B, V)

    def keepalive(self) -> None:
        """Called while the engine idles: a collective that fails here finds a dead rank before a request does."""
        self._send(("ping",))

    def close(self) -> None:
        self._send(("stop",))

    @staticmethod
    def _send(op: tuple) -> None:
        _collective(lambda: _broadcast(op))


def gather_logits(local, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Every rank's vocabulary slice of the logits of `hidden` (B, D); rank 0 gets (B, V), the others None."""
    part = local.lm_head(hidden).float()  # (B, ceil(V / N))
    if dist.get_rank() != 0:
        dist.gather(part, None, dst=0)
        return None
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size())]
    dist.gather(part, parts, dst=0)
    return torch.cat(parts, dim=-1)[:, :vocab_size]  # (B, V): the last slice's padding dropped


def serve_rank(local) -> None:
    """Ranks 1..N-1: run what rank 0 broadcasts until it says stop. Any failure leaves the group (so that rank 0's
    collectives fail at once) and raises."""
    device, dtype = local.lm_head.weight.device, local.lm_head.weight.dtype
    if device.type == "cpu":
        cpu_kernels.load()  # as rank 0's model runner does
    cache = hidden = None
    try:
        with torch.inference_mode():
            while (op := _broadcast(None))[0] != "stop":
                if op[0] == "forward":
                    _, chunks, block_size, positions, num_tokens, stack = op
                    inputs_embeds = torch.empty(num_tokens, local.config.hidden_size, dtype=dtype, device=device)
                    dist.broadcast(inputs_embeds, src=0)  # (T, D): rank 0's embeddings, images merged
                    deepstack = None
                    if stack is not None:  # (rows, features (R, L, D)) as rank 0 has them
                        shape, features_dtype = stack
                        deepstack = (torch.empty(shape[0], dtype=torch.long, device=device),
                                     torch.empty(shape, dtype=features_dtype, device=device))  # fmt: skip
                        dist.broadcast(deepstack[0], src=0)
                        dist.broadcast(deepstack[1], src=0)
                    meta = BatchMeta.build(chunks, block_size, device)
                    hidden = local(inputs_embeds, positions, cache, meta, deepstack)
                elif op[0] == "logits":
                    gather_logits(local, hidden[op[1]], local.config.vocab_size)
                elif op[0] == "cache":
                    cache = local.new_cache(op[1], op[2])
    except BaseException:
        _abort()
        raise


__all__ = [
    "ParallelLM",
    "RankFailure",
    "TPGroup",
    "check_divisible",
    "gather_logits",
    "init_process_group",
    "serve_rank",
]
