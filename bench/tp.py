"""Tensor parallelism on this machine's CPUs (`python -m bench.tp`): one decode step of the bench checkpoint
(forward + logits, batches of 1 and 32 sequences of 90..450 tokens) on one rank against two gloo ranks.

Cases, each in fresh processes: one rank with all the cores' threads (the baseline), one rank with one thread,
and two ranks with one thread each (rank 0 here, rank 1 in a child process, talking over gloo on localhost).
On a CPU the ranks share one memory bus, so this measures what the split and its all-reduces cost, not what
GPUs would gain. Medians of repeated timings; prints a markdown table with the ratio to the baseline.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.kernels import BS, _decode_batch, _timed
from demo.local import free_port
from llm import Qwen2LM
from llm.engine.threads import set_thread_intra_op_threads
from llm.model import BatchMeta
from llm.model.parallel import ParallelLM, TPGroup, init_process_group, serve_rank

CPU = torch.device("cpu")
CASES = {"1 rank, all threads (baseline)": (1, None), "1 rank, 1 thread": (1, 1), "2 ranks, 1 thread each": (2, 1)}


def _follow(checkpoint: str, dtype: str, init_method: str) -> None:
    torch.set_num_threads(1)
    init_process_group(1, 2, init_method, CPU, timeout_s=300)
    serve_rank(Qwen2LM.from_pretrained(checkpoint, dtype=getattr(torch, dtype), tp=TPGroup(1, 2)))


def _case(checkpoint: str, dtype: str, world_size: int, threads: int | None, rounds: int, out) -> None:
    """One case, in its own process: {batch: median ms per decode step}."""
    set_thread_intra_op_threads(threads or torch.get_num_threads())
    if world_size == 1:
        model = Qwen2LM.from_pretrained(checkpoint, dtype=getattr(torch, dtype))
    else:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        mp.get_context("spawn").Process(target=_follow, args=(checkpoint, dtype, init_method), daemon=True).start()
        init_process_group(0, 2, init_method, CPU, timeout_s=300)
        group = TPGroup(0, 2)
        model = ParallelLM(Qwen2LM.from_pretrained(checkpoint, dtype=getattr(torch, dtype), tp=group))
    cache = model.new_cache(3000, BS)
    times: dict[int, list[float]] = {1: [], 32: []}
    for _ in range(rounds):
        for n in times:
            chunks = _decode_batch(n, 90, 450, 3000)
            x = torch.randn(n, model.config.hidden_size, dtype=getattr(torch, dtype))
            pos = torch.tensor([c.start for c in chunks]).expand(3, -1)

            def step(chunks=chunks, x=x, pos=pos):
                with torch.inference_mode():
                    hidden = model(x, pos, cache, BatchMeta.build(chunks, BS, CPU))
                    model.logits(hidden, list(range(len(chunks))))

            times[n].append(_timed(step, 5))
    if world_size > 1:
        model.close()
        dist.destroy_process_group()
    out.put({n: statistics.median(t) for n, t in times.items()})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tp", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per case (medians)")
    p.add_argument("--out-dir", default="bench_results", help="where the bench checkpoint is cached")
    args = p.parse_args(argv)
    from bench.report import machine_info
    from bench.server import bench_checkpoint

    machine = machine_info()
    checkpoint = str(bench_checkpoint(Path(args.out_dir)))
    print(f"{machine['date']}  {machine['cpu']}  {machine['cores']} cores  torch {machine['torch']}\n")
    print("Decode step (forward + logits), bench checkpoint, ms; ratio = baseline / this\n")
    print("| dtype | batch | case | ms | vs baseline |\n| --- | --- | --- | --- | --- |")
    ctx = mp.get_context("spawn")
    for dtype in ("float32", "bfloat16"):
        results = {}
        for name, (world_size, threads) in CASES.items():
            out = ctx.Queue()
            proc = ctx.Process(target=_case, args=(checkpoint, dtype, world_size, threads, args.rounds, out))
            proc.start()
            results[name] = out.get(timeout=1800)
            proc.join()
        base = results[next(iter(CASES))]
        for n in (1, 32):
            for name, ms in results.items():
                print(f"| {dtype} | {n} | {name} | {ms[n]:.1f} | {base[n] / ms[n]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
