"""Per-sequence key/value cache, allocated once at its final size so memory is known before a sequence starts."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class KVCache:
    k: torch.Tensor  # (L, S_max, nkv, hd)
    v: torch.Tensor  # (L, S_max, nkv, hd)

    @classmethod
    def allocate(cls, num_layers: int, max_tokens: int, num_kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype) -> KVCache:
        shape = (num_layers, max_tokens, num_kv_heads, head_dim)
        return cls(torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype))

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


__all__ = ["KVCache"]
