"""A ViT slowed in proportion to its work, for the encoder-tier benchmarks: each batched forward first sleeps for the
batch's cost (encoders/cost.py's GFLOP estimate) times `seconds_per_gflop`, then runs the real tiny tower. A sleep
takes no core, so on a 2-core machine each replica adds capacity as a GPU of its own would, and a large image takes
as much longer than a thumbnail as it would on a real tower."""

from __future__ import annotations

import time

import torch

from encoders import ModelSpec, Qwen2VLVisionEncoder


class SlowViT(Qwen2VLVisionEncoder):
    def __init__(self, model_dir, device="cpu", dtype=torch.float32, *, seconds_per_gflop: float, config=None):
        super().__init__(model_dir, device, dtype, config=config)
        self.cost = ModelSpec.load(model_dir, device=device, config=config).image_cost
        self.seconds_per_gflop = seconds_per_gflop

    def forward(self, batch):
        time.sleep(self.seconds_per_gflop * sum(self.cost.gflop(grid) for _, grid in batch))
        return super().forward(batch)


class SleepViT(SlowViT):
    """A ViT that takes no CPU: each batched forward only sleeps for its cost, then returns zeros of the embeddings'
    shapes. Its replicas add capacity as GPUs of their own would, and what the encoder tier costs besides the ViT
    (decoding, preprocessing, the calls, the transfer) is all the CPU left to measure."""

    def forward(self, batch):
        time.sleep(self.seconds_per_gflop * sum(self.cost.gflop(grid) for _, grid in batch))
        merge = self.processing.merge_size**2
        return [torch.zeros(t * h * w // merge, self.hidden_size) for _, (t, h, w) in batch]


__all__ = ["SleepViT", "SlowViT"]
