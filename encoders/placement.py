"""Devices and dtypes per part of an encoder: the vision tower on one, the projector on another (say a bf16 ViT
on the GPU with an fp32 projector), and the start-up check that the largest image fits."""

from __future__ import annotations

import logging
import operator
import resource
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("ray.serve")


class Placed(nn.Module):
    """`inner` on its own device and dtype: inputs are moved there, outputs stay there."""

    def __init__(self, inner: nn.Module, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.inner, self.device, self.dtype = inner.to(device=device, dtype=dtype), device, dtype

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner(x.to(device=self.device, dtype=self.dtype), *args, **kwargs)


def place_projector(encoder: object, path: str, device: torch.device, dtype: torch.dtype) -> None:
    """Replace the module at `path` (e.g. "vit.merger") of `encoder` by itself on `device`/`dtype`."""
    parent_path, _, name = path.rpartition(".")
    parent = operator.attrgetter(parent_path)(encoder) if parent_path else encoder
    setattr(parent, name, Placed(getattr(parent, name), device, dtype))


def check_worst_case(forward: Callable[[], list[torch.Tensor]], device: torch.device, what: str) -> tuple[float, str]:
    """Run the worst batch once; log and return its time and peak memory, or refuse to start with the reason."""
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux: the process's peak so far
    start = time.monotonic()
    try:
        forward()
    except (torch.OutOfMemoryError, MemoryError) as e:
        raise RuntimeError(
            f"the encoder cannot encode its largest batch ({what}) on {device}: out of memory "
            f"({e}). Lower encoder.max_batch_patches (or max_pixels in preprocessor_config.json), or give the "
            f"encoder replica more memory (a GPU of its own, or a larger one)"
        ) from e
    peak = (
        f"peak {torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB on {device}"
        if on_gpu
        else f"process peak RSS +{(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024:.0f} MiB"
    )
    seconds = time.monotonic() - start
    logger.info("encoder start-up check: largest batch (%s) encoded in %.2f s, %s", what, seconds, peak)
    return seconds, peak


__all__ = ["Placed", "check_worst_case", "place_projector"]
