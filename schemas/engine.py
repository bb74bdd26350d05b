"""What the ingress hands the LLM replica, and what the LLM replica streams back (plain dataclasses: hot path)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length"]


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        assert self.max_tokens >= 1, self.max_tokens
        assert 0.0 <= self.temperature and 0.0 < self.top_p <= 1.0, (self.temperature, self.top_p)


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    # One (t, h, w) patch grid per image, in prompt order; rows of embeddings = t*h*w / merge_size**2.
    image_grid_thw: list[tuple[int, int, int]]
    # One ObjectRef per image (never the tensors themselves: the ingress must not hold embeddings).
    image_embed_refs: list[Any]
    sampling: SamplingParams

    def __post_init__(self) -> None:
        assert len(self.image_grid_thw) == len(self.image_embed_refs), "one grid per image"


@dataclass(slots=True)
class TokenChunk:
    """Token ids generated since the last chunk; `finish_reason` is set on the last one."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None


__all__ = ["FinishReason", "GenerateRequest", "SamplingParams", "TokenChunk"]
