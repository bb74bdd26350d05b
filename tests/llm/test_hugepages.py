"""The CPU KV cache and weights on huge pages (llm/model/hugepages.py): where Linux offers them, they are asked for,
and the tensors hold what they held."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from torch import nn

from llm.model import KVCache, hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping(t: torch.Tensor) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding t's first byte."""
    addr, current, fields = t.data_ptr(), False, {}
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            if current:
                break
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = lo <= addr < hi
        elif current:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def _asked_for_huge_pages(t: torch.Tensor) -> bool:
    """The mapping is madvised MADV_HUGEPAGE (VmFlags `hg`): what our code decides. Whether the kernel then finds
    free 2 MiB pages (AnonHugePages) depends on the machine's fragmentation: after a full test run it sometimes does
    not, and a test of that failed once in a run."""
    return "hg" in _mapping(t).get("VmFlags", "").split()


@pytest.fixture
def thp():
    if not THP.exists() or "[never]" in THP.read_text():
        pytest.skip("transparent huge pages are off on this machine")


def test_the_cpu_kv_cache_lives_on_huge_pages(thp):
    cache = KVCache.allocate(2, 256, 16, 4, 64, torch.device("cpu"), torch.float32)  # 16 MiB
    assert cache.kv.data_ptr() % hugepages.HUGE == 0
    assert torch.count_nonzero(cache.kv) == 0
    assert _asked_for_huge_pages(cache.kv)


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
    assert _asked_for_huge_pages(model[2].weight)


def test_small_tensors_are_plain():
    t = hugepages.empty(1000, torch.float32)
    assert t.shape == (1000,) and t.dtype == torch.float32


def test_collapse_asks_for_the_whole_huge_pages_inside_the_spans(monkeypatch):
    calls = []
    monkeypatch.setattr(hugepages, "_madvise", lambda addr, n, advice: calls.append((addr, n, advice)) or True)
    huge = hugepages.HUGE
    spans = [(5 * huge - 10, 2 * huge), (3 * huge + 100, 2 * huge - 200)]  # 1 MiB apart at most: one range
    assert hugepages.collapse(spans) == 2 * huge
    assert calls == [(4 * huge, 2 * huge, hugepages._MADV_COLLAPSE)]  # 8 MiB .. 12 MiB: whole pages only
    calls.clear()
    far = [(2 * huge, 2 * huge), (40 * huge, 2 * huge)]  # 36 huge pages apart: two ranges, nothing between filled
    assert hugepages.collapse(far) == 4 * huge
    assert calls == [(2 * huge, 2 * huge, hugepages._MADV_COLLAPSE), (40 * huge, 2 * huge, hugepages._MADV_COLLAPSE)]
    calls.clear()
    assert hugepages.collapse([(huge + 1, huge)]) == 0 and calls == []  # no whole page inside: not asked
    assert hugepages.collapse([]) == 0


def test_collapse_keeps_what_the_memory_held(thp):
    """On a kernel that has MADV_COLLAPSE (Linux 6.1+) and free huge pages, a buffer already written is backed by
    huge pages afterwards, holding the same bytes; elsewhere collapse says 0 and nothing changes. The buffer is a
    mapping of its own: after a long test run, malloc may serve 12 MiB from a thread arena's heap, whose first
    byte lies in another mapping than its whole pages (CI saw AnonHugePages 0 there after a collapse that worked)."""
    size = 6 * hugepages.HUGE  # 12 MiB: 5 whole huge pages at least, wherever the mapping starts
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = torch.frombuffer(region, dtype=torch.float32)
    buf.copy_(torch.randn(buf.numel()))  # written, on 4 KiB pages (the mapping was never madvised)
    before = buf.clone()
    done = hugepages.collapse([(buf.data_ptr(), size)])
    assert torch.equal(buf, before)
    if done:
        assert done >= 4 * hugepages.HUGE
        vmstat = [x for x in Path("/proc/vmstat").read_text().splitlines() if "collapse" in x or "split" in x]
        assert int(_mapping(buf)["AnonHugePages"].split()[0]) * 1024 >= done, (_mapping(buf), vmstat)
    del buf, before


def test_packed_linear_weights_are_collapsed_onto_huge_pages(monkeypatch, float32_packing):
    """oneDNN's packed copies (what a decode step streams) are allocated by oneDNN, on small pages: pack_linears asks
    for their range to be backed by huge pages. Our GEMM's panels are allocated on them."""
    from llm.model.layers import Linear, pack_linears

    seen = []
    monkeypatch.setattr(hugepages, "collapse", lambda spans: seen.append(spans) or 0)
    model = nn.Sequential(Linear(512, 1024), Linear(1024, 512))
    assert pack_linears(model) == 2
    [spans] = seen
    if float32_packing == "panels":
        assert spans == [] and all(m.packed[0].data_ptr() % hugepages.HUGE == 0 for m in model)
    else:
        expected = [(torch.ops.mkldnn.data_ptr(m.packed[0]), m.weight.numel() * 4) for m in model]
        assert sorted(spans) == sorted(expected)
