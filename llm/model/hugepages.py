"""CPU tensors on transparent huge pages: the KV cache and the weights of a CPU replica.

NOTE: a decode step reads every weight once and, at batch 32, about as many bytes of KV cache, scattered in
page-sized blocks wherever the block pool put them. On 4 KiB pages nearly every block costs a TLB miss and a page
walk (the L2 TLB covers ~8 MiB; a cache is hundreds), and the hardware prefetcher stops at each page's end. Linux
backs an anonymous region with 2 MiB pages when asked (`madvise(MADV_HUGEPAGE)`, the default THP mode "madvise"
honours it) before its first touch. Where it cannot (not Linux, THP "never"), the tensors are ordinary; nothing else
changes. BENCHMARKS.md has what it bought.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE = 1 << 21  # a 2 MiB page
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1+: back a range that is already in use by huge pages, now
_libc = None


def _madvise(addr: int, length: int, advice: int = _MADV_HUGEPAGE) -> bool:
    global _libc
    try:
        _libc = _libc or ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice) == 0
    except (OSError, AttributeError):
        return False


def collapse(spans: list[tuple[int, int]]) -> int:
    """Back the 2 MiB pages that lie wholly inside `spans` ((address, bytes) of buffers already written, e.g. oneDNN's
    packed weights, which its own allocations put in malloc's heap) by huge pages (`MADV_COLLAPSE`); returns the bytes
    collapsed, 0 where the kernel cannot (before Linux 6.1, THP "never"). Spans less than a huge page apart are taken
    as one range (what lies between them is heap memory already in use); farther apart, each range on its own, so
    that nothing mapped between them (and maybe never touched) is filled in."""
    ranges: list[list[int]] = []
    for addr, n in sorted(spans):
        if ranges and addr - ranges[-1][1] < HUGE:
            ranges[-1][1] = max(ranges[-1][1], addr + n)
        else:
            ranges.append([addr, addr + n])
    done = 0
    for lo, hi in ranges:
        start, end = -(-lo // HUGE) * HUGE, hi // HUGE * HUGE
        if end > start and _madvise(start, end - start, _MADV_COLLAPSE):
            done += end - start
    return done


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of numel elements, uninitialised, starting on a 2 MiB boundary of a region asked to be backed
    by huge pages (untouched until the caller writes it, so the kernel can give it huge pages from the start)."""
    size = torch.empty(0, dtype=dtype).element_size()
    if numel * size < HUGE:  # smaller than one huge page: nothing to gain
        return torch.empty(numel, dtype=dtype)
    pad = HUGE // size
    raw = torch.empty(numel + pad, dtype=dtype)  # (numel + pad,): large, so malloc maps it fresh, untouched
    start = -raw.data_ptr() % HUGE // size  # elements up to the first 2 MiB boundary
    buf = raw[start : start + numel]
    if not _madvise(buf.data_ptr(), numel * size):  # a last partial 2 MiB stays on small pages
        logger.info("huge pages not available here (madvise failed); CPU tensors use ordinary pages")
    return buf


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on huge pages (first touched by the zeroing)."""
    return empty(math.prod(shape), dtype).zero_().view(shape)


def move_parameters(module: nn.Module) -> int:
    """Every CPU parameter and buffer of module into one huge-page arena (each a view of it, in order); returns the
    bytes moved. Tied parameters stay tied (each is moved once)."""
    unique = {id(t): t for t in (*module.parameters(), *module.buffers())}
    tensors = [t for t in unique.values() if t.device.type == "cpu"]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    moved = 0
    with torch.no_grad():
        for dtype, group in by_dtype.items():
            arena = empty(sum(t.numel() for t in group), dtype)
            offset = 0
            for t in group:
                view = arena[offset : offset + t.numel()].view(t.shape).copy_(t)
                t.data = view
                offset += t.numel()
            moved += arena.numel() * arena.element_size()
    return moved


__all__ = ["collapse", "empty", "move_parameters", "zeros"]
