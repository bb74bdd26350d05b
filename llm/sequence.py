"""One request's state inside the engine: its tokens, where its KV lives, and what a chunk of it looks like."""

from __future__ import annotations

import time

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llm.block_pool import block_hash
from schemas import SamplingParams, TokenChunk


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]  # the prompt, then every generated token
    prompt_len: int
    prompt_positions: torch.Tensor  # (3, P) CPU: M-RoPE positions of the prompt
    rope_delta: int  # a generated token at index i sits at position i + rope_delta
    is_multimodal: torch.Tensor  # (P,) bool CPU: image placeholder positions of the prompt
    image_embeds: torch.Tensor | None  # (num placeholders, D) on the model's device, in prompt order
    image_spans: list[tuple[int, int, str]]  # per image: placeholder run [start, end) and its content key
    params: SamplingParams
    emit: Callable[[TokenChunk | BaseException], None]
    generator: torch.Generator | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks, in order
    num_computed: int = 0  # tokens whose KV is in the cache
    num_cached: int | None = None  # prompt tokens found in the prefix cache when first admitted
    output_counts: torch.Tensor | None = None  # (V,) generated-token counts, for penalties
    arrived_at: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # first step with this sequence in it
    last_token_at: float | None = None
    _mm_rows: torch.Tensor = field(init=False)  # (P+1,) image rows before each prompt position

    def __post_init__(self) -> None:
        assert self.prompt_positions.shape == (3, self.prompt_len), self.prompt_positions.shape
        self._mm_rows = torch.cat([torch.zeros(1, dtype=torch.long), self.is_multimodal.long().cumsum(0)])

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def positions(self, a: int, b: int) -> torch.Tensor:
        """(3, b - a) positions of tokens [a, b): the prompt's own, then cache index + rope delta."""
        p = self.prompt_len
        parts = []
        if a < p:
            parts.append(self.prompt_positions[:, a : min(b, p)])
        if b > p:
            parts.append((torch.arange(max(a, p), b) + self.rope_delta).expand(3, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def embed_chunk(self, embed: Callable[[torch.Tensor], torch.Tensor], a: int, b: int,
                    merge: Callable[..., torch.Tensor]) -> torch.Tensor:
        """Input embeddings of tokens [a, b), image rows merged in (a chunk may cut an image: rows follow)."""
        x = embed(torch.tensor(self.token_ids[a:b]))  # (b - a, D)
        pa, pb = min(a, self.prompt_len), min(b, self.prompt_len)
        r0, r1 = int(self._mm_rows[pa]), int(self._mm_rows[pb])
        if r1 > r0:
            mask = torch.zeros(b - a, dtype=torch.bool)
            mask[: pb - pa] = self.is_multimodal[pa:pb]
            assert self.image_embeds is not None
            x = merge(x, mask, self.image_embeds[r0:r1])
        return x

    def _image_keys(self, a: int, b: int) -> list[str]:
        return [f"{key}@{max(a, s) - s}" for s, e, key in self.image_spans if s < b and e > a]

    def prefix_hashes(self, block_size: int, n_tokens: int) -> list[bytes]:
        """Hashes of the full blocks among the first `n_tokens` tokens, chained from the start."""
        hashes = list(self.block_hashes[: n_tokens // block_size])
        parent = hashes[-1] if hashes else b""
        for i in range(len(hashes), n_tokens // block_size):
            a, b = i * block_size, (i + 1) * block_size
            parent = block_hash(parent, self.token_ids[a:b], self._image_keys(a, b))
            hashes.append(parent)
        return hashes


__all__ = ["Sequence"]
