"""The CPU KV cache and weights on huge pages (llm/model/hugepages.py): where Linux offers them, they are used, and
the tensors hold what they held."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from llm.model import KVCache, hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_bytes(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping holding t's first byte (/proc/self/smaps), in bytes."""
    addr, current = t.data_ptr(), None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = lo <= addr < hi
        elif current and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.fixture
def thp():
    if not THP.exists() or "[never]" in THP.read_text():
        pytest.skip("transparent huge pages are off on this machine")


def test_the_cpu_kv_cache_lives_on_huge_pages(thp):
    cache = KVCache.allocate(2, 256, 16, 4, 64, torch.device("cpu"), torch.float32)  # 16 MiB
    assert cache.kv.data_ptr() % hugepages.HUGE == 0
    assert torch.count_nonzero(cache.kv) == 0
    assert _huge_bytes(cache.kv) >= 8 * hugepages.HUGE


def test_parameters_move_into_one_huge_arena_with_their_values_and_ties(thp):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(2048, 512), nn.Linear(512, 2048), nn.Linear(2048, 2048, bias=False))
    model[2].weight = nn.Parameter(torch.randn(2048, 2048))
    head = nn.Linear(512, 2048, bias=False)
    head.weight = model[0].weight  # tied, as an lm_head to its embedding table
    model.append(head)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moved = hugepages.move_parameters(model)
    assert moved >= sum(p.numel() * 4 for p in model.parameters())
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert model[3].weight is model[0].weight
    ptrs = sorted(p.data_ptr() for p in model.parameters())
    assert ptrs[0] % hugepages.HUGE == 0 and ptrs[-1] - ptrs[0] < moved  # views of one arena
    assert _huge_bytes(model[2].weight) >= 8 * hugepages.HUGE


def test_small_tensors_are_plain():
    t = hugepages.empty(1000, torch.float32)
    assert t.shape == (1000,) and t.dtype == torch.float32
