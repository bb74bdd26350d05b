"""`make bench-kernels`, part 3: the float32 linears of a decode or prefill step, oneDNN on its packed weights (what
the engine ran before) against our GEMM on panels of 16 columns (llm/model/cpu_gemm.h), on one thread.

All the bench checkpoint's linear weights (8 layers' qkv, o, gate_up and down, and lm_head: ~94 MB, more than this
VM's L3) are run once per pass, in order, as a step runs them, so each weight comes from memory as in a step.
Passes at each row count alternate between the two, round-robin, and the medians are compared."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from llm import Qwen2LM
from llm.model import cpu_kernels
from llm.model.layers import Linear, RowParallelLinear

ROWS = (1, 8, 32, 64, 256, 1024)


def bench_gemm(checkpoint: Path, rounds: int) -> list[tuple[int, float, float, float]]:
    """(rows, oneDNN ms, ours ms, ours GFLOP/s) per row count; [] where our GEMM does not run on this CPU."""
    cpu_kernels.load()
    model = Qwen2LM.from_pretrained(checkpoint, dtype=torch.float32)
    weights = [
        m.weight
        for m in model.modules()
        if isinstance(m, Linear | RowParallelLinear) and cpu_kernels.panels_for(m.weight)
    ]
    if not weights or not cpu_kernels.can_pack():
        return []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        onednn = [cpu_kernels.pack(w) for w in weights]
        panels = [cpu_kernels.panels(w) for w in weights]
        flops_per_row = 2 * sum(w.numel() for w in weights)
        rows = []
        for n in ROWS:
            xs = {k: torch.randn(n, k) for k in {w.shape[1] for w in weights}}
            cases = {
                "onednn": lambda: [cpu_kernels.linear(xs[w.shape[1]], w, None, p) for w, p in zip(weights, onednn)],
                "ours": lambda: [cpu_kernels.linear(xs[w.shape[1]], w, None, (p,)) for w, p in zip(weights, panels)],
            }
            times: dict[str, list[float]] = {name: [] for name in cases}
            reps = max(1, 64 // n)
            for _ in range(rounds):
                for name, fn in cases.items():
                    fn()
                    t = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    times[name].append((time.perf_counter() - t) / reps * 1e3)
            a, b = statistics.median(times["onednn"]), statistics.median(times["ours"])
            rows.append((n, a, b, flops_per_row * n / b / 1e6))
        return rows
    finally:
        torch.set_num_threads(threads)


def report(rows: list[tuple[int, float, float, float]]) -> list[str]:
    if not rows:
        return ["our float32 GEMM does not run on this CPU (no AVX2)"]
    out = ["| rows | oneDNN, packed (before) ms | ours, panels ms | time, ours / oneDNN | ours GFLOP/s |"]
    out.append("| --- | --- | --- | --- | --- |")
    out += [f"| {n} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {g:.1f} |" for n, a, b, g in rows]
    return out
