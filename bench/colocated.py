"""Disaggregated encoders against an encoder colocated in the LLM replica (`make bench-colocated`).

The same app, checkpoint and requests, twice: `encoder.colocated` off (encoder replicas of their own) and on (the
LLM replica encodes). Text-only probe streams run throughout (long outputs, closed loop) while image-heavy requests
arrive as a Poisson stream; measured: TTFT of the image requests, and TPOT of the probes, whose decode steps an
encoder in the same replica holds up. On a CPU machine both modes share the same cores (the Ray cluster is the same
size); on a GPU machine the colocated encoder shares the LLM's GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import torch

from bench.client import _one
from bench.metrics import RequestResult, aggregate
from bench.prefix import ENCODER_HEAVY
from bench.server import bench_checkpoint, serve_app
from bench.workload import data_url, noise_png, stream_body


def image_requests(n: int, images: int, size: tuple[int, int], seed: int) -> list[dict]:
    out = []
    for i in range(n):
        rng = np.random.default_rng(seed * 1000 + i)  # new pixels every request: no cache hits
        parts = [{"type": "image_url", "image_url": {"url": data_url(noise_png(*size, rng))}} for _ in range(images)]
        out.append(stream_body([*parts, {"type": "text", "text": f"Describe picture set {i}."}], 8))
    return out


async def run(url: str, args: argparse.Namespace) -> tuple[list[RequestResult], list[RequestResult], float]:
    bodies = image_requests(args.image_requests, args.images, tuple(args.size), args.seed)
    gaps = np.random.default_rng(args.seed).exponential(1.0 / args.rate, len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout) as client:
        t0, done = time.perf_counter(), asyncio.Event()

        async def probe(k: int) -> list[RequestResult]:
            results = []
            while not done.is_set():
                body = stream_body(f"Probe {k}: count slowly from one upwards.", args.probe_tokens)
                results.append(await _one(client, k, body, t0, args.timeout))
            return results

        async def images() -> list[RequestResult]:
            tasks = []
            for i, (body, gap) in enumerate(zip(bodies, gaps, strict=True)):
                await asyncio.sleep(gap)
                tasks.append(asyncio.create_task(_one(client, i, body, t0, args.timeout)))
            out = list(await asyncio.gather(*tasks))
            done.set()
            return out

        probes = [asyncio.create_task(probe(k)) for k in range(args.probes)]
        image_results = await images()
        probe_results = [r for t in probes for r in await t]
        return image_results, probe_results, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image-requests", type=int, default=24)
    p.add_argument("--images", default="4", help="images per image request; a comma list sweeps them (1,2,4,8)")
    p.add_argument("--size", type=int, nargs=2, default=(448, 336), help="image width height")
    p.add_argument("--rate", type=float, default=1.0, help="image requests per second (Poisson)")
    p.add_argument("--probes", type=int, default=4, help="text-only streams running throughout")
    p.add_argument("--probe-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument(
        "--disaggregated-args",
        type=json.loads,
        default={},
        help='JSON merged into the disaggregated run\'s app args, e.g. \'{"llm": {"cpu_threads": 1}}\'',
    )
    p.add_argument("--out-dir", default="bench_results")
    args = p.parse_args(argv)
    counts = [int(n) for n in str(args.images).split(",")]
    ckpt = bench_checkpoint(Path(args.out_dir), ENCODER_HEAVY)
    report: dict[str, dict[int, dict]] = {}
    for mode, colocated in (("disaggregated", False), ("colocated", True)):
        overrides = {"encoder": {"colocated": True}} if colocated else args.disaggregated_args
        with serve_app(ckpt, max_images=max(counts), overrides=overrides) as url:
            for n in counts:
                one = argparse.Namespace(**{**vars(args), "images": n})
                asyncio.run(run(url, argparse.Namespace(**{**vars(one), "image_requests": 2, "seed": args.seed + 1})))
                images, probes, wall = asyncio.run(run(url, one))
                report.setdefault(mode, {})[n] = {
                    "images": aggregate(images, wall, 1e9, 1e9),
                    "probes": aggregate(probes, wall, 1e9, 1e9),
                }
    stamp = datetime.now(UTC)
    header = (
        f"{stamp.isoformat(timespec='seconds')}  {platform.processor() or platform.machine()}  torch "
        f"{torch.__version__}  {torch.get_num_threads()} threads; {args.image_requests} image requests of "
        f"{args.size[0]}x{args.size[1]} images at {args.rate}/s, {args.probes} text probes"
    )
    print(header)
    rows = [
        ("image TTFT p50", "images", "ttft_ms", "p50"),
        ("image TTFT p99", "images", "ttft_ms", "p99"),
        ("probe TPOT p50", "probes", "tpot_ms", "p50"),
        ("probe TPOT p99", "probes", "tpot_ms", "p99"),
    ]
    for n in counts:
        print(f"\n{n} images per request{'':>3} {'disaggregated':>14} {'colocated':>10} {'colocated/disagg':>17}")
        for name, part, metric, pct in rows:
            d, c = (report[m][n][part][metric][pct] for m in ("disaggregated", "colocated"))
            print(f"{name:24} {d:12.0f}ms {c:8.0f}ms {c / d:16.2f}x")
        for mode in report:
            failed = report[mode][n]["images"]["failed"] + report[mode][n]["probes"]["failed"]
            print(f"{mode}: {report[mode][n]['probes']['completed']} probe streams, {failed} failed requests")
    out = Path(args.out_dir) / f"colocated-{stamp.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"args": vars(args), "report": report}, indent=1))
    plot(out.with_suffix(".png"), report, counts, header)
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def plot(path: Path, report: dict[str, dict[int, dict]], counts: list[int], title: str) -> None:
    """Image-request TTFT (p50, p99) against images per request, and the text probes' p99 TPOT, per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, by_n in report.items():
        left.plot(counts, [by_n[n]["images"]["ttft_ms"]["p50"] for n in counts], marker="o", label=f"{mode} p50")
        left.plot(
            counts, [by_n[n]["images"]["ttft_ms"]["p99"] for n in counts], marker="o", ls="--", label=f"{mode} p99"
        )
        right.plot(counts, [by_n[n]["probes"]["tpot_ms"]["p99"] for n in counts], marker="o", label=mode)
    for ax, ylabel in ((left, "image request TTFT (ms)"), (right, "text streams' p99 TPOT (ms)")):
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_xlabel("images per request")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
