"""`make bench-encoder-scaling`: the encoder tier under a load step of mixed image sizes, scaled and routed on request
counts against on cost, side by side in one run.

One Ray cluster, one app per configuration in turn, each fed the same seeded load: from t=0, Poisson arrivals of
one-image requests (`max_tokens` 1, so a request's latency is its image's time to first token), most of them
thumbnails, some 1-4 MP photos. The ViT is slowed in proportion to its work (bench/slow_vit.py: it sleeps for each
batch's cost, the FLOPs encoders/cost.py estimates, as a tower many times the tiny one's size would take), so replicas
add capacity as GPUs would, on a 2-core machine. Each configuration starts at one Encoder replica and may scale to
`--max-replicas`, with serve_config.yaml's delays. Configurations:
- `count`: Serve's request-count policy (`target_ongoing_requests`, 4 as serve_config.yaml's comment offers) and its
  default router (power of two choices on requests in flight);
- `cost+serve`: the cost policy (deployments/encoder/autoscaling.py) with Serve's router;
- `cost`: the cost policy and the cost router (deployments/encoder/router.py), as shipped.
Both cost configurations take the target the replica measures at start (bench/slow_vit.py's sleep included).
Reported per configuration: p50/p99 image TTFT (all, thumbnails, large), Encoder replica-seconds over the run, the
most replicas, when the policy first asked for more (a replica STARTING) and when the second one started serving
after the step: the policy's own delay apart from the replica's start."""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from bench.server import QUIET, bench_checkpoint, ray_serve, wait_healthy
from bench.slow_vit import SlowViT
from encoders import ModelSpec
from tests.helpers import data_url, make_image

# A small LM (the prompts' prefill is not what is measured) with a ViT that takes photos up to 1 MP (max_pixels).
CHECKPOINT = dict(
    seed=0, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vision_embed_dim=32,
    vision_depth=1, vision_heads=2, init_std=0.02, max_pixels=1024 * 1024,
)  # fmt: skip
DELAYS = {"upscale_delay_s": 1, "downscale_delay_s": 30, "metrics_interval_s": 1, "look_back_period_s": 5}
CONFIGS = ("count", "cost+serve", "cost")


@dataclass
class Request:
    at: float  # seconds after the step
    large: bool
    url: str


@dataclass
class Run:
    name: str
    latencies: list[tuple[bool, float, int]] = field(default_factory=list)  # (large, seconds, status)
    replicas: list[tuple[float, int]] = field(default_factory=list)  # (seconds after the step, RUNNING replicas)
    asked: list[tuple[float, int]] = field(default_factory=list)  # (seconds after the step, replicas asked for)
    end: float = 0.0
    target_cost: float | None = None  # GFLOP per replica, as the Encoder measured it at start (cost policy)

    def pct(self, q: float, large: bool | None = None) -> float:
        xs = sorted(s for big, s, status in self.latencies if status == 200 and large in (None, big))
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    def replica_seconds(self) -> float:
        points = [*self.replicas, (self.end, self.replicas[-1][1])]
        return sum((t1 - t0) * n for (t0, n), (t1, _) in zip(points, points[1:], strict=False) if t0 < self.end)

    def second_replica_at(self) -> float | None:
        return next((t for t, n in self.replicas if n >= 2), None)

    def scale_up_asked_at(self) -> float | None:
        return next((t for t, n in self.asked if n >= 2), None)

    def errors(self) -> int:
        return sum(status != 200 for _, _, status in self.latencies)


def workload(rate: float, duration_s: float, large_share: float, seed: int) -> list[Request]:
    """Poisson arrivals; thumbnails of 48-160 px a side, large photos of 1-4 MP (PNG, JPEG)."""
    rng, out, t = np.random.default_rng(seed), [], 0.0
    while (t := t + rng.exponential(1 / rate)) < duration_s:
        if rng.random() < large_share:
            side = int(rng.integers(1000, 2001))
            image = make_image(64, 64, seed=len(out)).resize((side, int(side * rng.uniform(0.75, 1.0))))
            out.append(Request(t, True, data_url(image, "JPEG")))
        else:
            w, h = (int(x) for x in rng.integers(48, 161, 2))
            out.append(Request(t, False, data_url(make_image(w, h, seed=len(out)))))
    return out


def deploy(name: str, checkpoint: Path, max_replicas: int, seconds_per_gflop: float) -> str:
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from deployments.encoder.autoscaling import POLICY_PATH
    from deployments.encoder.server import Encoder
    from deployments.ingress import Ingress
    from deployments.llm.server import LLM

    args = {"model": str(checkpoint), "llm": {"max_model_len": 4096}, "encoder": {"cache_gib": 0}}
    policy = {"target_ongoing_requests": 4} if name == "count" else {"policy": {"policy_function": POLICY_PATH}}
    options = {
        "autoscaling_config": {"min_replicas": 1, "max_replicas": max_replicas, **DELAYS, **policy},
        "ray_actor_options": {"num_cpus": 0.25},
    }
    if name != "cost":
        options["request_router_config"] = RequestRouterConfig()  # Serve's default: power of two on counts
    slow = functools.partial(SlowViT, seconds_per_gflop=seconds_per_gflop)
    encoder = Encoder.options(**options).bind(args, model_factory=slow)
    llm = LLM.options(ray_actor_options={"num_cpus": 1}).bind(args)
    app = Ingress.options(ray_actor_options={"num_cpus": 0.25}).bind(encoder, llm, args)
    serve.run(app, name=name, route_prefix=f"/{name}", logging_config=QUIET)
    return name


def replica_counts(app: str) -> tuple[int, int]:
    """(RUNNING, asked for: RUNNING and those on their way) Encoder replicas of `app`."""
    from ray import serve

    states = serve.status().applications[app].deployments["Encoder"].replica_states
    return states.get("RUNNING", 0), sum(states.get(s, 0) for s in ("RUNNING", "STARTING", "UPDATING", "RECOVERING"))


def running(app: str) -> int:
    return replica_counts(app)[0]


async def drive(url: str, model: str, load: list[Request], run: Run) -> None:
    async def one(client: httpx.AsyncClient, r: Request, start: float) -> None:
        await asyncio.sleep(max(0.0, start + r.at - time.monotonic()))
        parts = [{"type": "image_url", "image_url": {"url": r.url}}, {"type": "text", "text": "?"}]
        body = {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": 1}
        sent = time.monotonic()
        try:
            status = (await client.post("/v1/chat/completions", json=body)).status_code
        except httpx.HTTPError:
            status = 0
        run.latencies.append((r.large, time.monotonic() - sent, status))
        run.end = max(run.end, time.monotonic() - start)

    limits = httpx.Limits(max_connections=len(load))
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        start = time.monotonic()
        stop = threading.Event()

        def look(at: float) -> None:
            live, asked = replica_counts(run.name)
            run.replicas.append((at, live))
            run.asked.append((at, asked))

        look(0.0)

        def poll() -> None:
            while not stop.wait(0.25):
                look(time.monotonic() - start)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            await asyncio.gather(*(one(client, r, start) for r in load))
        finally:
            stop.set()
            poller.join()


def measure(name: str, port: int, checkpoint: Path, load: list[Request], args: argparse.Namespace) -> Run:
    from ray import serve

    deploy(name, checkpoint, args.max_replicas, args.seconds_per_gflop)
    url = f"http://127.0.0.1:{port}/{name}"
    try:
        wait_healthy(url, 180)
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        warm = workload(1.0, 3.0, 0.0, seed=args.seed + 1)  # not counted: first calls of each replica
        asyncio.run(drive(url, model, warm, Run(name)))
        deadline = time.monotonic() + 120
        while running(name) != 1 and time.monotonic() < deadline:  # every configuration starts at one replica
            time.sleep(1)
        run = Run(name)
        if name != "count":
            run.target_cost = serve.get_deployment_handle("Encoder", name).stats.remote().result()["target_cost"]
        asyncio.run(drive(url, model, load, run))
        return run
    finally:
        serve.delete(name)


def report(runs: list[Run], load: list[Request], args: argparse.Namespace) -> str:
    n_large = sum(r.large for r in load)
    lines = [
        f"encoder scaling: {len(load)} requests ({n_large} large) over {args.duration:g} s at {args.rate:g}/s, "
        f"seed {args.seed}, 1-{args.max_replicas} Encoder replicas, ViT {args.large_s:g} s per 1 MP photo",
        "",
        f"{'config':<12}{'p50 s':>8}{'p99 s':>8}{'p99 thumb':>11}{'p99 large':>11}{'replica-s':>11}"
        f"{'max':>5}{'asked at s':>12}{'2nd at s':>10}{'errors':>8}{'target GFLOP':>14}",
    ]

    def seconds(t: float | None, width: int) -> str:
        return f"{'-' if t is None else format(t, '.1f'):>{width}}"

    for r in runs:
        lines.append(
            f"{r.name:<12}{r.pct(0.5):>8.2f}{r.pct(0.99):>8.2f}{r.pct(0.99, False):>11.2f}{r.pct(0.99, True):>11.2f}"
            f"{r.replica_seconds():>11.1f}{max(n for _, n in r.replicas):>5}"
            f"{seconds(r.scale_up_asked_at(), 12)}{seconds(r.second_replica_at(), 10)}{r.errors():>8}"
            f"{'-' if r.target_cost is None else format(r.target_cost, '.2f'):>14}"
        )
    by = {r.name: r for r in runs}
    if "count" in by and "cost" in by:
        count, cost = by["count"], by["cost"]
        lines += [
            "",
            f"encoder scaling: p99 image TTFT count/cost = {count.pct(0.99) / cost.pct(0.99):.2f}x, "
            f"replica-seconds cost/count = {cost.replica_seconds() / count.replica_seconds():.2f}x",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second after the step")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--large-share", type=float, default=0.2, help="share of 1-4 MP photos")
    parser.add_argument("--max-replicas", type=int, default=4)
    parser.add_argument("--large-s", type=float, default=1.0, help="the slowed ViT's time for a 1 MP photo")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_results/encoder-scaling.txt"))
    args = parser.parse_args(argv)
    checkpoint = bench_checkpoint(Path("bench_results/checkpoints"), CHECKPOINT)
    spec = ModelSpec.load(checkpoint, device="cpu")
    args.seconds_per_gflop = args.large_s / spec.image_cost.gflop(spec.processing.grid_thw(1024, 1024))
    load = workload(args.rate, args.duration, args.large_share, args.seed)
    with ray_serve() as port:
        runs = [measure(name, port, checkpoint, load, args) for name in args.configs.split(",")]
    text = report(runs, load, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
