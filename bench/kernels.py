"""The engine's CPU hot spots, each against the way it was done before (`python -m bench.kernels`).

1. Decode attention for one layer over the paged cache, 32 sequences of 90..450 tokens (seeded), the bench
   checkpoint's heads (8 query heads on 4 KV heads of 64): the first code (token-major cache, one padded
   batch, `scaled_dot_product_attention` with a boolean mask and `enable_gqa`) against `llm.model.paged_attention`'s
   gather (head-major cache, grouped matmuls, with and without length groups: the path without the C++ kernel)
   and its in-place C++ kernel (llm/model/cpu_kernels.cpp).
2. One forward of the bench checkpoint's decoder (decode steps of 1 and 32 sequences) on a worker thread, as the
   engine runs it: with the process's loading thread also owning an OpenMP team (before) against the worker
   alone owning one (`llm.engine.threads`). Each case runs in its own process: a thread team cannot be undone.

3. The float32 linears of a step on one thread, oneDNN's packed weights against our GEMM's panels (bench/gemm.py).

4. The whole decode step (forward + logits, batches 1, 8 and 32, float32 and bfloat16) with this tree's `llm`
   against a baseline commit's (`--baseline`, default e422682: before the fused layers), ops per layer and ms,
   in alternating child processes (bench/step_ab.py). Its last line:
   `decode step: N ops per layer; bf16 batch 1 A ms (was B); bf16 batch 32 C ms (was D)`.

Medians of repeated timings taken round-robin over the cases, so a burst of other load hits them alike. Prints
markdown tables with the ratio to the "before" row.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from llm import Qwen2LM
from llm.engine.threads import set_thread_intra_op_threads
from llm.model import BatchMeta, ChunkSpec, cpu_kernels, paged_attention
from llm.model import attention as attention_module

NH, NKV, HD, BS = 8, 4, 64, 16


def _decode_batch(n: int, lo: int, hi: int, num_blocks: int, seed: int = 0) -> list[ChunkSpec]:
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    chunks = []
    for start in sorted(rng.randint(lo, hi) for _ in range(n)):
        chunks.append(ChunkSpec([free.pop() for _ in range(start // BS + 1)], start, 1))
    return chunks


def _timed(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def bench_attention(rounds: int, threads: int) -> list[tuple[str, str, float]]:
    torch.set_num_threads(threads)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        chunks = _decode_batch(32, 90, 450, 3000)
        q, k, v = (torch.randn(32, h, HD, dtype=dtype) for h in (NH, NKV, NKV))
        head_major = torch.randn(2 * NKV, 3000, BS, HD, dtype=dtype)  # KVCache's layout (one layer): keys, values
        token_major = head_major[:NKV].permute(1, 2, 0, 3).contiguous()  # (blocks, bs, nkv, hd): the previous layout
        kv = torch.cat([k, v], dim=1)  # (32, 2 * NKV, HD)
        nb = max(c.start for c in chunks) // BS + 1
        table = torch.tensor([c.block_ids + [0] * (nb - len(c.block_ids)) for c in chunks]).flatten()
        starts = torch.tensor([c.start for c in chunks])
        mask = (torch.arange(nb * BS)[None, :] <= starts[:, None])[:, None, None, :]

        def before():
            rows_ = token_major.view(3000, -1)
            ks = rows_.index_select(0, table).view(32, -1, NKV, HD).transpose(1, 2)
            vs = rows_.index_select(0, table).view(32, -1, NKV, HD).transpose(1, 2)
            return F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, attn_mask=mask, enable_gqa=True)

        def current(meta_chunks=chunks):
            meta = BatchMeta.build(meta_chunks, BS, torch.device("cpu"))
            return paged_attention(q, kv, head_major, meta, scale=HD**-0.5)

        one_group, kernels = attention_module.decode_groups, cpu_kernels.load()

        def gather(groups=one_group):  # the path without the C++ kernel (its absence, and cuda's eager path)
            attention_module.decode_groups, cpu_kernels._module = groups, None
            try:
                return current()
            finally:
                attention_module.decode_groups, cpu_kernels._module = one_group, kernels

        cases = {
            "masked SDPA, one padded batch (before)": before,
            "grouped matmuls, one padded batch": lambda: gather(lambda n: [(0, len(n))] if n else []),
            "grouped matmuls, length groups (the fallback)": gather,
            "in-place C++ kernel (now)": current,
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(rounds):
            for name, fn in cases.items():
                times[name].append(_timed(fn, 10))
        rows += [(str(dtype).removeprefix("torch."), name, statistics.median(t)) for name, t in times.items()]
    return rows


def _forward_case(case: str, checkpoint: Path, dtype: str, threads: int, rounds: int) -> dict[str, float]:
    """Runs in a child process: `teams` loads the model with `threads` process-wide (the loading thread gets a
    team), `solo` with one thread process-wide and `threads` for the worker alone."""
    torch.set_num_threads(threads if case == "teams" else 1)
    model = Qwen2LM.from_pretrained(checkpoint, dtype=getattr(torch, dtype))
    torch.ones(1 << 20).mul_(2)  # a parallel op on this thread, as loading and cache allocation do
    cache = model.new_cache(3000, BS)
    result: dict[str, float] = {}

    def worker():
        if case == "solo":
            set_thread_intra_op_threads(threads)
        else:
            torch.set_num_threads(threads)
        batches = {n: _decode_batch(n, 90, 450, 3000) for n in (1, 32)}
        times: dict[int, list[float]] = {n: [] for n in batches}
        for _ in range(rounds):
            for n, chunks in batches.items():
                x = torch.randn(n, model.config.hidden_size, dtype=model.lm_head.weight.dtype)
                pos = torch.tensor([c.start for c in chunks]).expand(3, -1)

                def step(chunks=chunks, x=x, pos=pos):
                    with torch.inference_mode():
                        model(x, pos, cache, BatchMeta.build(chunks, BS, torch.device("cpu")))

                times[n].append(_timed(step, 5))
        result.update({f"batch {n}": statistics.median(t) for n, t in times.items()})

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    return result


def bench_threads(checkpoint: Path, threads: int, rounds: int) -> list[tuple[str, str, str, float]]:
    rows = []
    for dtype in ("float32", "bfloat16"):
        for case, label in (("teams", "loading thread has a team too (before)"), ("solo", "worker's team alone (now)")):
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.kernels",
                    "--child",
                    case,
                    "--dtype",
                    dtype,
                    "--checkpoint",
                    str(checkpoint),
                    "--threads",
                    str(threads),
                    "--rounds",
                    str(rounds),
                ],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            for batch, ms in json.loads(out.strip().splitlines()[-1]).items():
                rows.append((dtype, batch, label, ms))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per case (medians)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the measured thread")
    p.add_argument("--out-dir", default="bench_results", help="where the bench checkpoint is cached")
    p.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child", choices=("teams", "solo"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--baseline", default="e422682", help="the commit the decode step is compared with")
    p.add_argument("--step-rounds", type=int, default=3, help="alternating child runs per tree (decode step)")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_forward_case(args.child, Path(args.checkpoint), args.dtype, args.threads, args.rounds)))
        return 0
    from bench.report import machine_info
    from bench.server import bench_checkpoint

    machine = machine_info()
    print(f"{machine['date']}  {machine['cpu']}  {machine['cores']} cores  torch {machine['torch']}\n")
    print("1. Decode attention, one layer, 32 sequences of 90..450 tokens (ms; ratio = before / this)\n")
    print("| dtype | implementation | ms | speed-up |\n| --- | --- | --- | --- |")
    rows = bench_attention(args.rounds, args.threads)
    for dtype, name, ms in rows:
        before = next(m for d, n, m in rows if d == dtype and n.endswith("(before)"))
        print(f"| {dtype} | {name} | {ms:.2f} | {before / ms:.2f}x |")
    checkpoint = Path(args.checkpoint) if args.checkpoint else bench_checkpoint(Path(args.out_dir))
    print("\n2. Decoder forward on a worker thread, bench checkpoint, decode step (ms; ratio = before / this)\n")
    print("| dtype | batch | OpenMP teams | ms | speed-up |\n| --- | --- | --- | --- | --- |")
    rows2 = bench_threads(checkpoint, args.threads, args.rounds)
    for dtype, batch, label, ms in rows2:
        before = next(m for d, b, lab, m in rows2 if d == dtype and b == batch and lab.endswith("(before)"))
        print(f"| {dtype} | {batch} | {label} | {ms:.1f} | {before / ms:.2f}x |")
    from bench import gemm
    from bench.step_ab import baseline_tree, compare, report

    print("\n3. The float32 linears of one step (all the bench checkpoint's weights, from memory), one thread\n")
    print("\n".join(gemm.report(gemm.bench_gemm(checkpoint, args.rounds))))
    print(f"\n4. Decode step (forward + logits) of the bench checkpoint, this tree against {args.baseline}\n")
    results = compare(
        checkpoint,
        baseline_tree(args.baseline, Path(args.out_dir)),
        threads=args.threads,
        rounds=args.step_rounds,
        reps=10,
        dtypes="float32,bfloat16",
        batches="1,8,32",
    )
    print("\n".join(report(results, args.baseline)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
