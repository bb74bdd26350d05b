"""The command line of `make bench` (bench/run.py)."""

from __future__ import annotations

import argparse
import json

from bench.workload import parse_sizes

QUICK = dict(concurrency="1,4", num_prompts=8, input_len=64, output_len=16, images_max=2,
             image_sizes="64x64,112x112", baseline_max_prompts=8)  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    p.add_argument("--quick", action="store_true", help=f"a ~1 minute smoke run: {QUICK} (explicit flags win)")
    p.add_argument("--concurrency", default="1,4,16,32", help="comma-separated: most requests in flight per run")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per run (default: max(8, 2*concurrency))")
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals at this many req/s, still capped at the concurrency (default: closed loop)",
    )
    p.add_argument("--input-len", type=int, default=256, help="text tokens per prompt (images come on top)")
    p.add_argument("--output-len", type=int, default=64, help="mean output tokens (forced with ignore_eos)")
    p.add_argument("--range-ratio", type=float, default=0.5, help="output lengths uniform in len*(1 -/+ ratio)")
    p.add_argument("--images-min", type=int, default=1, help="fewest images per request")
    p.add_argument("--images-max", type=int, default=4, help="most images per request")
    p.add_argument("--image-sizes", default="64x64,112x112,224x160", help="WxH list; each image draws one")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput: TTFT at most this")
    p.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput: TPOT at most this")
    p.add_argument(
        "--baseline-max-prompts",
        type=int,
        default=None,
        help="cap on requests the transformers baselines run per concurrency (default: all)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weights and activations of every system (the app's `dtype`, the in-process engine, transformers)",
    )
    p.add_argument("--baseline-threads", type=int, default=2, help="torch threads for the baselines")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request counts as failed")
    p.add_argument("--warmup", type=int, default=8, help="warm-up requests (not measured) before the runs")
    p.add_argument("--skip-server", action="store_true", help="no run of the app over HTTP")
    p.add_argument("--skip-baselines", action="store_true", help="no transformers baselines")
    p.add_argument("--skip-in-process", action="store_true", help="no in-process run of our engine")
    p.add_argument("--out-dir", default="bench_results", help="JSON, PNG and the cached checkpoint go here")
    p.add_argument(
        "--app-args",
        type=json.loads,
        default={},
        help='JSON merged into the app\'s args, e.g. \'{"llm": {"stream_interval_ms": 50}}\'',
    )
    quick, _ = p.parse_known_args(argv)
    if quick.quick:
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    args.concurrencies = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    if not args.concurrencies or min(args.concurrencies) < 1:
        p.error("--concurrency needs positive integers")
    if args.input_len < 1 or args.output_len < 1 or not 0 <= args.range_ratio < 1:
        p.error("--input-len and --output-len must be >= 1, --range-ratio in [0, 1)")
    if (args.num_prompts is not None and args.num_prompts < 1) or args.warmup < 0 or (args.request_rate or 1) <= 0:
        p.error("--num-prompts must be >= 1, --warmup >= 0, --request-rate > 0")
    args.sizes = parse_sizes(args.image_sizes)
    return args


__all__ = ["QUICK", "parse_args"]
