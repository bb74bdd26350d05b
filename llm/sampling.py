"""Next-token choice per request: greedy at temperature 0, otherwise temperature + top-p with a per-request seed."""

from __future__ import annotations

import torch

from schemas import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A seeded generator makes a request reproducible whatever else the replica is doing."""
    if params.temperature == 0.0:
        return None
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits (V,) float32 -> token id, a 0-d tensor still on the logits' device."""
    if params.temperature == 0.0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / params.temperature, dim=-1)  # (V,)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    # Gumbel-max in its exponential form: argmax(p / E), E ~ Exp(1), samples from p without a host sync
    # (the trick nano-vllm uses).
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / noise).argmax(-1)


__all__ = ["make_generator", "sample"]
