"""What encoding a unit of vision work costs, known from its grid alone (before any pixel work): the ViT's FLOPs, a
linear term per patch plus an attention term per sequence. One formula for every family; each family module says
its tower's shape (`qwen2_vl_cost`, `qwen2_5_vl_cost`, `llava_cost`). The router, the autoscaler and the metrics all
read the cost from here, in GFLOP."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class VisionCost:
    """A tower's shape, as far as its FLOPs go.

    NOTE: FLOPs, not seconds: the same image costs the same on every replica, and a replica's speed is its own
    setting (`encoder.target_cost_per_replica`). Norms, activations and RoPE are left out (a few % of the total)."""

    flops_per_patch: float  # linear layers: patch embedding, q/k/v/o and MLP of every layer run, the projector
    width: int  # the ViT's hidden size: one (query, key) pair costs 4 * width FLOPs (scores, then weighted values)
    full_layers: int  # layers attending over a whole sequence (an image, a video frame, a LLaVA-NeXT crop)
    window_layers: int = 0  # layers attending within windows of `window` patches (Qwen2.5-VL)
    window: int = 0
    extra_tokens: int = 0  # tokens the tower adds to each sequence (CLIP's CLS)

    def __post_init__(self) -> None:
        assert self.flops_per_patch > 0 and self.width > 0, self
        assert self.window_layers == 0 or self.window > 0, self

    def gflop(self, grid_thw: tuple[int, int, int]) -> float:
        """`grid_thw`: t sequences of h x w patches each (t: 1 for an image, its frames for a video, its crops for
        LLaVA-NeXT), as the families' `grid_thw` give it; the ViT attends within each sequence."""
        t, h, w = grid_thw
        n = h * w + self.extra_tokens  # tokens of one sequence
        pairs = self.full_layers * n * n + self.window_layers * n * min(n, self.window)  # (query, key) pairs
        return t * (n * self.flops_per_patch + 4 * self.width * pairs) / 1e9

    def attention_share(self, grid_thw: tuple[int, int, int]) -> float:
        """The attention term's share of `gflop` (for tests and the docs)."""
        linear = VisionCost(self.flops_per_patch, self.width, 0, extra_tokens=self.extra_tokens)
        total = self.gflop(grid_thw)
        return (total - linear.gflop(grid_thw)) / total


def linear_flops(*shapes: tuple[float, float]) -> float:
    """2 FLOPs per multiply-accumulate of each (in, out) matrix."""
    return 2.0 * sum(i * o for i, o in shapes)


__all__ = ["VisionCost", "linear_flops"]
