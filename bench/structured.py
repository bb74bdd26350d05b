"""`make bench-structured`: structured outputs under load (issue 21's row). The app as `make serve` runs it, on the
bench checkpoint; c=32 streamed requests with one 112x112 image each, greedy, all free against half of them under a
json_schema, alternating the two runs (so a burst of other load hits both alike). Prints a table and, last, the ratio
of output tokens/s: the grammar must not halve throughput.

A schema-constrained answer ends where its grammar does (ignore_eos cannot go past it), so its outputs are shorter:
the table gives the mean output length and TPOT beside tokens/s, and TPOT (the step's cost per token) is the fairer
comparison."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench.client import load
from bench.metrics import aggregate
from bench.workload import chat_body, make_workload

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue", "yellow"]},
        "count": {"type": "integer"},
        "shapes": {"type": "array", "items": {"type": "string"}},
        "box": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}},
    },
    "required": ["colour", "count", "shapes", "box"],
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "scene", "schema": SCHEMA}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64, help="requests per run")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2, help="alternating pairs of runs (medians)")
    p.add_argument("--out-dir", default="bench_results")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from bench import peer_servers
    from bench.report import machine_info
    from bench.server import bench_checkpoint, served_model_name

    out_dir = Path(args.out_dir)
    ckpt = bench_checkpoint(out_dir)
    reqs = make_workload(
        AutoTokenizer.from_pretrained(ckpt), args.num_prompts + 4, seed=7, input_len=32, images_min=1,
        images_max=1, image_sizes=[(112, 112)], output_len=args.output_len, range_ratio=0.0, fixed_sizes=True,
    )  # fmt: skip
    m = machine_info()
    print(f"{m['date']}  {m['cpu']}, {m['cores']} cores, load average {m['loadavg_at_start']}", flush=True)
    runs: dict[str, list[dict]] = {"free": [], "half json_schema": []}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with peer_servers.ours(ckpt, out_dir, stamp, {}, 600.0) as (url, _):
        model = served_model_name(url)
        free = [chat_body(r, model) for r in reqs[4:]]
        half = [{**b, "response_format": FORMAT} if i % 2 else b for i, b in enumerate(free)]
        load(url, [{**chat_body(r, model), "response_format": FORMAT} for r in reqs[:4]], 4, None, 300)  # warm-up
        for _ in range(args.rounds):
            for name, bodies in (("free", free), ("half json_schema", half)):
                rs, wall = load(url, bodies, args.concurrency, None, 600)
                agg = aggregate(rs, wall, float("inf"), float("inf"))
                agg["mean_out"] = statistics.mean(r.output_tokens for r in rs if r.ok) if agg["completed"] else 0
                runs[name].append(agg)
                print(f"{name}: {agg['out_tok_per_s']:.0f} tok/s, {agg['failed']} failed", flush=True)
    med = {n: {k: statistics.median(a[k] for a in rs) for k in ("out_tok_per_s", "mean_out")} for n, rs in runs.items()}
    tpot = {n: statistics.median(a["tpot_ms"]["p50"] or 0 for a in rs) for n, rs in runs.items()}
    print(f"\n| c={args.concurrency}, {args.num_prompts} requests | output tok/s | mean output tokens | TPOT p50 ms |")
    print("| --- | --- | --- | --- |")
    for n in runs:
        print(f"| {n} | {med[n]['out_tok_per_s']:.0f} | {med[n]['mean_out']:.0f} | {tpot[n]:.0f} |")
    ratio = med["half json_schema"]["out_tok_per_s"] / med["free"]["out_tok_per_s"]
    print(f"\nstructured: half json_schema / free at c={args.concurrency}: {ratio:.2f}x tok/s, "
          f"TPOT p50 {tpot['half json_schema'] / tpot['free']:.2f}x")  # fmt: skip
    return 0 if all(a["failed"] == 0 for rs in runs.values() for a in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
