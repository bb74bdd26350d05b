"""Programmatic dependent launch for our Triton kernels on Hopper and later: opt-in, not yet timed.

A decode step's kernels run one after another, each a few microseconds, and on an H200 each costs ~2 us beyond its
own work in a CUDA graph (BENCHMARKS.md, GPU): the launch, the ramp of its programs and the tail of the one before.
With the launch attribute (`launch_pdl`) a kernel may start while the one before it finishes; its programs then wait
(`griddepcontrol.wait`, Triton's `gdc_wait`) before they touch any memory, so what it reads and writes is as without
it, and graph capture keeps the dependency as a programmatic edge. The one exception is `prefetch`: a GEMM's
programs first ask for their opening weight tiles into L2 (gemm_kernel), which no kernel writes, so that the stream
starts before the wait ends. Off by default until a GPU run measures it: bench/gpu_decode.py's "pdl" mode turns
`enabled` on ("pdl-wait": without the prefetch). (The mechanism is CUDA's; vLLM and FlashInfer launch their kernels so
on Hopper. The weight prefetch ahead of the wait is the idea of CUTLASS's example 63, a Hopper GEMM with L2 weight
prefetch.)
"""

from __future__ import annotations

import torch

enabled = False  # bench/gpu_decode.py's "pdl" mode
prefetch = True  # with it, each GEMM program loads its first weight tiles into L2 before it waits (gemm_kernel)


def kwargs(device: torch.device) -> dict:
    """A kernel launch's PDL arguments: the kernel's `PDL` constexpr, and Triton's launch option where it applies
    (cuda, compute capability 9 or more)."""
    if enabled and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9:
        return dict(PDL=True, launch_pdl=True)
    return dict(PDL=False)


__all__ = ["enabled", "kwargs", "prefetch"]
