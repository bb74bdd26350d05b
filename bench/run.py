"""`python -m bench.run`: the serving benchmark (modelled on `vllm bench serve`); see bench/README.md."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
import time
import traceback
from pathlib import Path

from bench import report
from bench.metrics import aggregate
from bench.run_args import parse_args
from bench.server import CHECKPOINT_PARAMS, bench_checkpoint
from bench.workload import BenchRequest, make_workload, output_range, poisson_arrivals


def _say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _n_prompts(args: argparse.Namespace, c: int) -> int:
    return args.num_prompts if args.num_prompts is not None else max(8, 2 * c)


def _arrivals(args: argparse.Namespace, n: int) -> list[float] | None:
    return poisson_arrivals(n, args.request_rate, args.seed) if args.request_rate else None


def _slos(args: argparse.Namespace) -> tuple[float, float]:
    return args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000


def run_server(
    args: argparse.Namespace,
    ckpt: Path,
    warm: list[BenchRequest],
    sets: dict[int, list[BenchRequest]],
    runs: dict,
    records: dict,
) -> None:
    from bench.client import load
    from bench.server import serve_app, served_model_name
    from bench.workload import chat_body

    with serve_app(ckpt, max_images=args.images_max, overrides={"dtype": args.dtype, **args.app_args}) as url:
        from ray import serve

        # The app has one LLM replica (serve_app's default): its counters are every message sent to the ingress.
        llm = serve.get_deployment_handle("LLM", app_name="bench")

        def messages_sent() -> int:
            stats = llm.stats.remote().result()
            return stats["stream_messages"] + stats["channel_messages"]

        model = served_model_name(url)
        _say(f"server up at {url} (model {model!r}); {len(warm)} warm-up request(s)")
        # Short but complete requests, a few at once, so the batched paths and each image size are warm too.
        bodies = [{**chat_body(r, model), "max_tokens": min(8, r.output_len)} for r in warm]
        for r in load(url, bodies, min(4, max(1, len(bodies))), None, args.request_timeout)[0]:
            if not r.ok:
                _say(f"warm-up request {r.index} failed: {r.error}")
        for c, requests in sets.items():
            n, sent = len(requests), messages_sent()
            results, wall = load(
                url, [chat_body(r, model) for r in requests], c, _arrivals(args, n), args.request_timeout
            )
            agg = aggregate(results, wall, *_slos(args))
            agg["llm_messages"] = messages_sent() - sent
            tokens = sum(r.output_tokens for r in results if r.ok)
            agg["messages_per_token"] = agg["llm_messages"] / tokens if tokens else None
            runs["ours"][c], records["ours"][c] = agg, [r.to_json() for r in results]
            _say(
                f"ours c={c}: {n} requests in {wall:.1f}s, {agg['out_tok_per_s']:.1f} out tok/s, {agg['failed']} failed"
            )


def run_in_process(
    args: argparse.Namespace,
    ckpt: Path,
    warm: list[BenchRequest],
    sets: dict[int, list[BenchRequest]],
    runs: dict,
    records: dict,
) -> None:
    from bench.inprocess import InProcess

    runner = InProcess(ckpt, args.baseline_threads, dtype=args.dtype)
    runner.run([dataclasses.replace(r, output_len=min(8, r.output_len)) for r in warm], min(4, len(warm)))
    for c, requests in sets.items():
        results, wall = runner.run(requests, c)
        agg = aggregate(results, wall, *_slos(args))
        runs["ours-in-process"][c], records["ours-in-process"][c] = agg, [r.to_json() for r in results]
        _say(f"ours-in-process c={c}: {agg['out_tok_per_s']:.1f} out tok/s")


def run_baselines(
    args: argparse.Namespace,
    ckpt: Path,
    warm: list[BenchRequest],
    sets: dict[int, list[BenchRequest]],
    runs: dict,
    records: dict,
    checks: dict,
) -> None:
    from bench.baselines import HFRunner, run_one_at_a_time, run_static_batches

    runner = HFRunner(ckpt, args.baseline_threads, dtype=args.dtype)
    probe = warm + [r for rs in sets.values() for r in rs]
    pair = [probe[0], next((r for r in probe[1:] if len(r.images) != len(probe[0].images)), probe[-1])]
    problem = runner.self_check(pair) if len(probe) > 1 else None
    checks["padded_batch_self_check"] = problem or "ok: padded-batch greedy tokens equal the unbatched ones"
    _say(f"baseline self-check: {checks['padded_batch_self_check']}")
    if problem and "NOT a near-tie" in problem:
        print(f"WARNING: the static-batch baseline may be wrong: {problem}", file=sys.stderr, flush=True)
    runner.generate([probe[0]], steps=4)  # warm-up: first-call allocations and lazy inits
    mismatches = {}
    for c, requests in sets.items():
        n = len(requests)
        cap = args.baseline_max_prompts or n
        measured, timed = min(n, cap), {}
        results, wall = run_one_at_a_time(runner, requests, c, measured, timed, _arrivals(args, n))
        agg = aggregate(results, wall, *_slos(args))
        if measured < n:
            agg["note"] = f"service times of the first {measured} requests, replayed for all {n}"
        runs["hf-one-at-a-time"][c], records["hf-one-at-a-time"][c] = agg, [r.to_json() for r in results]
        _say(f"hf-one-at-a-time c={c}: {agg['out_tok_per_s']:.1f} out tok/s ({measured} requests timed)")
        # Same requests: the server's prompt lengths (usage) must equal transformers' for each request both ran.
        ours = {r["index"]: r["prompt_tokens"] for r in records["ours"].get(c, []) if r["ok"]}
        mismatches.update(
            {(c, i): (ours[i], t.prompt_tokens) for i, t in timed.items() if i in ours and ours[i] != t.prompt_tokens}
        )
        if c == 1:  # a static batch of one is the one-at-a-time server
            runs["hf-static-batch"][c] = {**agg, "note": "batch of 1: the one-at-a-time figures"}
            continue
        m = min(n, math.ceil(max(cap, c) / c) * c)  # whole batches, at least one
        results, wall = run_static_batches(runner, requests[:m], c, _arrivals(args, m))
        agg = aggregate(results, wall, *_slos(args))
        if m < n:
            agg["note"] = f"first {m} of {n} requests ({m // c} batch(es) of {c})"
        runs["hf-static-batch"][c], records["hf-static-batch"][c] = agg, [r.to_json() for r in results]
        _say(f"hf-static-batch c={c}: {agg['out_tok_per_s']:.1f} out tok/s")
    if records["ours"]:
        checks["prompt_tokens_match"] = (
            "ok" if not mismatches else f"MISMATCH {{(c, request): (ours, transformers)}}: {mismatches}"
        )
        _say(f"prompt lengths, ours vs transformers: {checks['prompt_tokens_match']}")


def _param_count(ckpt: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    machine = report.machine_info()
    _say(f"{machine['date']} on {machine['cpu']} ({machine['cores']} cores), torch {machine['torch']}")
    if machine["loadavg_at_start"][0] > 0.5:
        _say(
            f"WARNING: load average {machine['loadavg_at_start']} before starting (another process, or a run "
            "that just ended): busy CPUs skew the figures"
        )
    ckpt = bench_checkpoint(out_dir)
    shape = {**CHECKPOINT_PARAMS, "parameters": _param_count(ckpt), "path": str(ckpt)}
    _say(f"checkpoint {ckpt}: {shape['parameters']:,} parameters")

    from transformers import AutoTokenizer

    # Every run gets requests the server has not seen (a prefix or embedding cache must not flatter later runs);
    # request i depends only on (seed, i), so the same flags give the same requests.
    sizes = [_n_prompts(args, c) for c in args.concurrencies]
    total = sum(sizes) + args.warmup
    pool = make_workload(
        AutoTokenizer.from_pretrained(ckpt),
        total,
        seed=args.seed,
        input_len=args.input_len,
        images_min=args.images_min,
        images_max=args.images_max,
        image_sizes=args.sizes,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
    )
    ends = list(itertools.accumulate(sizes))
    sets = {c: pool[end - n : end] for c, n, end in zip(args.concurrencies, sizes, ends)}
    warm = pool[ends[-1] :]
    workload = {
        "requests": sizes,
        "warmup": args.warmup,
        "text_tokens_mean": sum(r.text_tokens for r in pool) / total,
        "images_mean": sum(len(r.images) for r in pool) / total,
        "output_len_range": output_range(args.output_len, args.range_ratio),
        "output_len_mean": sum(r.output_len for r in pool) / total,
    }
    _say(f"workload: {workload}")

    runs: dict = {s: {} for s in report.SYSTEMS}
    records: dict = {s: {} for s in report.SYSTEMS}
    checks: dict = {}
    status = 0
    if not args.skip_server:
        try:
            run_server(args, ckpt, warm, sets, runs, records)
        except Exception as e:  # the report still comes out, with what failed
            traceback.print_exc()
            checks["server_error"] = f"{type(e).__name__}: {e}"
            status = 1
    if not args.skip_in_process:
        run_in_process(args, ckpt, warm, sets, runs, records)
    if not args.skip_baselines:
        run_baselines(args, ckpt, warm, sets, runs, records, checks)
    for c, agg in runs["ours"].items():  # what serving costs: the served path against the same engine in-process
        inproc = runs["ours-in-process"].get(c)
        agg["served_over_in_process"] = (
            agg["out_tok_per_s"] / inproc["out_tok_per_s"] if inproc and inproc["out_tok_per_s"] else None
        )

    mode = f"Poisson {args.request_rate} req/s" if args.request_rate else "closed loop"
    print(
        f"\n{machine['date']}  {machine['platform']}  {machine['cpu']}  {machine['cores']} cores  "
        f"torch {machine['torch']}  transformers {machine['transformers']}  ray {machine['ray']}"
    )
    print(
        f"checkpoint: hidden {shape['hidden_size']}, {shape['num_layers']} layers, {shape['num_heads']} heads "
        f"({shape['num_kv_heads']} kv), ffn {shape['intermediate_size']}, vision {shape['vision_embed_dim']}x"
        f"{shape['vision_depth']}, max_pixels {shape['max_pixels']}: {shape['parameters']:,} parameters, {args.dtype}"
    )
    print(f"workload: {workload}; SLOs TTFT <= {args.slo_ttft_ms:.0f} ms, TPOT <= {args.slo_tpot_ms:.0f} ms")
    print(report.format_tables(runs, args.concurrencies, mode))
    for name, value in checks.items():
        print(f"check {name}: {value}")
    if any(agg["completed"] == 0 for agg in runs["ours"].values()):
        status = 1

    payload = {
        "machine": machine,
        "args": {k: v for k, v in vars(args).items() if k != "sizes"},
        "checkpoint": shape,
        "workload": workload,
        "mode": mode,
        "runs": runs,
        "tpot_check": report.tpot_check(runs, args.concurrencies),
        "checks": checks,
        "requests": records,
    }
    json_path, png_path = out_dir / f"bench-{stamp}.json", out_dir / f"bench-{stamp}.png"
    report.write_json(json_path, payload)
    report.plot(
        png_path,
        runs,
        f"{machine['date']} {machine['cpu']} ({machine['cores']} cores), {mode}, "
        f"in {args.input_len}+images, out ~{args.output_len}, {args.dtype}",
    )
    print(f"\nwrote {json_path} and {png_path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
