"""The paged KV cache tensors: one pool of fixed-size blocks per layer, allocated once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm.model import hugepages


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


__all__ = ["KVCache", "num_kv_blocks"]
