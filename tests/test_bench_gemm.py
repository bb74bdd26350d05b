"""`make bench-kernels`' GEMM part (bench/gemm.py) runs both packings on a checkpoint and reports them."""

from __future__ import annotations

import torch

from bench import gemm
from llm.model import cpu_kernels


def test_the_gemm_bench_times_both_packings_per_row_count(checkpoint, monkeypatch):
    monkeypatch.setattr(gemm, "ROWS", (1, 7))
    rows = gemm.bench_gemm(checkpoint, rounds=1)
    lines = gemm.report(rows)
    if not cpu_kernels.panels_for(torch.empty(16, 8)):
        assert rows == [] and "does not run" in lines[0]
        return
    assert [n for n, *_ in rows] == [1, 7] and all(a > 0 and b > 0 and g > 0 for _, a, b, g in rows)
    assert len(lines) == 4 and lines[2].startswith("| 1 |") and lines[3].startswith("| 7 |")
