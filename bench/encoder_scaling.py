"""`make bench-encoder-scaling`: the encoder tier under a load step of mixed image sizes, scaled and routed on request
counts against on cost, side by side in one run.

One Ray cluster, one app per configuration in turn, each fed the same seeded load: from t=0, Poisson arrivals of
one-image requests (`max_tokens` 1, so a request's latency is its image's time to first token), most of them
thumbnails, some 1-4 MP photos. The ViT is slowed in proportion to its work (bench/slow_vit.py: it sleeps for each
batch's cost, the FLOPs encoders/cost.py estimates, as a tower many times the tiny one's size would take), so replicas
add capacity as GPUs would, on a 2-core machine. Each configuration starts at one Encoder replica and may scale to
`--max-replicas`, with the Encoder's shipped delays (deployments/encoder/autoscaling.py). Configurations:
- `count`: Serve's request-count policy (`target_ongoing_requests`, 4 as serve_config.yaml's comment offers) and its
  default router (power of two choices on requests in flight);
- `cost+serve`: the cost policy (deployments/encoder/autoscaling.py) with Serve's router;
- `cost`: the cost policy and the cost router (deployments/encoder/router.py), as shipped (one replica starting at a
  time per node: here, one);
- `cost+together`: the same, every replica it asks for started at once (`policy_kwargs: {max_starting: N}`, as the
  policy was before it paced them: on one small node they share its cores).
The cost configurations take the target the replica measures at start (bench/slow_vit.py's sleep included).
Reported per configuration: p50/p99 image TTFT (all, thumbnails, large), Encoder replica-seconds over the run, the
most replicas, when the policy first asked for more (a replica STARTING) and when the second one started serving
after the step: the policy's own delay apart from the replica's start; then each replica that started during the
run, its start phase by phase as it measured them (deployments/replica.py, exported as `vlm_encoder_start_seconds`).
With `--baseline REF` (by default main before issue 53) the same load runs on that commit's code too, in a git
worktree of its own, with its own bench (count and cost), `--rounds` times (4), in the order A B, B A, ...: one run's
tails move 2x and its replica-seconds 15% on a shared 2-core VM, so each round's rows and ratios are printed, then
each configuration's mean over the rounds, and the last line compares the means of the shipped cost policy now and
the count policy then (the median start over every round):
`encoder scaling: start Ss; p99 image TTFT before/now Rx; replica-seconds now/before Qx`."""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np

from bench.server import QUIET, bench_checkpoint, ray_serve, wait_healthy
from bench.slow_vit import SlowViT
from demo.inputs import data_url, make_image
from demo.local import free_port
from deployments.encoder.autoscaling import AUTOSCALING
from deployments.replica import START_PHASES
from encoders import ModelSpec

# A small LM (the prompts' prefill is not what is measured) with a ViT that takes photos up to 1 MP (max_pixels).
CHECKPOINT = dict(
    seed=0, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vision_embed_dim=32,
    vision_depth=1, vision_heads=2, init_std=0.02, max_pixels=1024 * 1024,
)  # fmt: skip
DELAYS = {k: v for k, v in AUTOSCALING.items() if k.endswith("_s")}  # the shipped delays and intervals
CONFIGS = ("count", "cost+serve", "cost", "cost+together")
BASELINE = "9c039ac"  # main before issue 53: replicas started in 14-21 s here


@dataclass
class Start:
    """One replica's start, as it measured it: seconds per phase, and when it served its first image (epoch s)."""

    phases: dict[str, float] = field(default_factory=dict)
    serving_since: float | None = None

    def after(self, decision: float) -> dict[str, float]:
        """Seconds of each phase after `decision` (epoch s): what the scale-up waited for. The phases end one after
        the other at the first image; a process started before the decision (had one been ready) counts 0 of it."""
        assert self.serving_since is not None
        end, out = self.serving_since, {}
        for phase in reversed([p for p in START_PHASES if p in self.phases]):
            begin = end - self.phases[phase]
            out[phase] = max(0.0, end - max(begin, decision))
            end = begin
        return {p: out[p] for p in START_PHASES if p in out}


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
    began: float = 0.0  # the step, in epoch seconds
    starts: dict[str, Start] = field(default_factory=dict)  # by replica id, from the metrics

    def new_starts(self) -> list[tuple[float | None, float, Start]]:
        """Each replica that first served during the run, in order: (the policy asked for it, it served: both in
        seconds after the step, its phases). The k-th new replica was asked for when the count asked first reached
        1 + k."""
        served = sorted(
            (s.serving_since - self.began, s) for s in self.starts.values()
            if s.serving_since is not None and s.serving_since >= self.began
        )  # fmt: skip
        out = []
        for k, (at, start) in enumerate(served, 1):
            asked = next((t for t, n in self.asked if n >= 1 + k), None)
            out.append((asked, at, start))
        return out

    def start_spans(self) -> list[float]:
        """Each new replica's time from the policy's decision to its first image."""
        return [at - asked for asked, at, _ in self.new_starts() if asked is not None]

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
    from encoders.checkpoint_config import plain_config, read_config

    args = {"model": str(checkpoint), "llm": {"max_model_len": 4096}, "encoder": {"cache_gib": 0}}
    policy = {"target_ongoing_requests": 4} if name == "count" else {"policy": {"policy_function": POLICY_PATH}}
    if name == "cost+together":
        policy["policy"]["policy_kwargs"] = {"max_starting": max_replicas}
    options = {
        "autoscaling_config": {"min_replicas": 1, "max_replicas": max_replicas, **DELAYS, **policy},
        "ray_actor_options": {"num_cpus": 0.25},
    }
    if name not in ("cost", "cost+together"):
        options["request_router_config"] = RequestRouterConfig()  # Serve's default: power of two on counts
    slow = functools.partial(SlowViT, seconds_per_gflop=seconds_per_gflop)
    config = plain_config(read_config(checkpoint))  # as the app builder sends it (deployments/app.py)
    encoder = Encoder.options(**options).bind(args, model_factory=slow, config=config)
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


def scrape_starts(metrics_port: int, app: str, into: dict[str, Start]) -> None:
    """The Encoder replicas' start phases and first-image times of `app`, from Ray's Prometheus endpoint."""
    try:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return
    for line in text.splitlines():
        metric, _, rest = line.partition("{")
        if metric not in ("ray_vlm_encoder_start_seconds", "ray_vlm_encoder_serving_since_timestamp_seconds"):
            continue
        tag_text, _, value = rest.rpartition("} ")
        tags = dict(re.findall(r'(\w+)="([^"]*)"', tag_text))
        if tags.get("application") != app or "replica" not in tags:
            continue
        start = into.setdefault(tags["replica"], Start())
        if metric == "ray_vlm_encoder_start_seconds":
            start.phases[tags["phase"]] = float(value)
        else:
            start.serving_since = float(value)


async def drive(url: str, model: str, load: list[Request], run: Run, metrics_port: int | None = None) -> None:
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
        start, run.began = time.monotonic(), time.time()
        stop = threading.Event()

        def look(at: float) -> None:
            live, asked = replica_counts(run.name)
            run.replicas.append((at, live))
            run.asked.append((at, asked))

        look(0.0)

        def poll() -> None:
            scraped = 0.0
            while not stop.wait(0.25):
                look(time.monotonic() - start)
                if metrics_port is not None and time.monotonic() - scraped > 1.0:  # a replica gone keeps its last
                    scrape_starts(metrics_port, run.name, run.starts)
                    scraped = time.monotonic()

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            await asyncio.gather(*(one(client, r, start) for r in load))
        finally:
            stop.set()
            poller.join()
            if metrics_port is not None:
                time.sleep(2.0)  # the last replica's metrics: reported every second, then exported
                scrape_starts(metrics_port, run.name, run.starts)


def measure(
    name: str, port: int, checkpoint: Path, load: list[Request], args: argparse.Namespace, metrics_port: int
) -> Run:
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
        asyncio.run(drive(url, model, load, run, metrics_port))
        return run
    finally:
        serve.delete(name)


@dataclass
class Row:
    """One configuration's line of the table: this run's, or the baseline's as its own bench printed it."""

    name: str
    p50: float
    p99: float
    p99_thumb: float
    p99_large: float
    replica_s: float
    most: int
    asked: float | None
    second: float | None
    errors: int
    target: float | None

    @classmethod
    def of(cls, r: Run) -> Row:
        return cls(
            r.name, r.pct(0.5), r.pct(0.99), r.pct(0.99, False), r.pct(0.99, True), r.replica_seconds(),
            max(n for _, n in r.replicas), r.scale_up_asked_at(), r.second_replica_at(), r.errors(), r.target_cost,
        )  # fmt: skip

    @classmethod
    def parse(cls, line: str, suffix: str) -> Row:
        """A row of this table as printed (the baseline's bench prints the same columns)."""
        name, *cells = line.split()

        def num(cell: str) -> float | None:
            return None if cell == "-" else float(cell)

        f = [num(c) for c in cells]
        return cls(f"{name}@{suffix}", *f[:5], int(f[5]), f[6], f[7], int(f[8]), f[9])  # type: ignore[arg-type]

    @classmethod
    def mean(cls, rows: list[Row]) -> Row:
        """The rows' mean, named `<name> mean` (a time the policy never reached in a round is left out of its mean)."""

        def avg(xs: list[float | None]) -> float | None:
            known = [x for x in xs if x is not None]
            return statistics.mean(known) if known else None

        cells = {f: avg([getattr(r, f) for r in rows]) for f in ("p50", "p99", "p99_thumb", "p99_large", "replica_s")}
        times = {f: avg([getattr(r, f) for r in rows]) for f in ("asked", "second", "target")}
        most, errors = max(r.most for r in rows), sum(r.errors for r in rows)
        return cls(f"{rows[0].name} mean", **cells, most=most, errors=errors, **times)  # type: ignore[arg-type]

    def format(self) -> str:
        def cell(t: float | None, width: int, digits: int = 1) -> str:
            return f"{'-' if t is None else format(t, f'.{digits}f'):>{width}}"

        return (
            f"{self.name:<16}{self.p50:>8.2f}{self.p99:>8.2f}{self.p99_thumb:>11.2f}{self.p99_large:>11.2f}"
            f"{self.replica_s:>11.1f}{self.most:>5}{cell(self.asked, 12)}{cell(self.second, 10)}{self.errors:>8}"
            f"{cell(self.target, 14, 2)}"
        )


HEADER = (
    f"{'config':<16}{'p50 s':>8}{'p99 s':>8}{'p99 thumb':>11}{'p99 large':>11}{'replica-s':>11}"
    f"{'max':>5}{'asked at s':>12}{'2nd at s':>10}{'errors':>8}{'target GFLOP':>14}"
)


def baseline_rows(ref: str, args: argparse.Namespace) -> tuple[str, list[Row]]:
    """The same load on `ref`'s code: its own bench in a git worktree (bench_results/baseline-<sha>), run in a child
    process with its own Ray; (the commit, its rows)."""
    sha = subprocess.run(
        ["git", "rev-parse", "--short", ref], capture_output=True, text=True, check=True
    ).stdout.strip()
    tree = Path("bench_results") / f"baseline-{sha}"
    if not (tree / "bench" / "encoder_scaling.py").is_file():
        subprocess.run(["git", "worktree", "add", "--detach", "--force", str(tree), sha], check=True)
    out = "baseline-encoder-scaling.txt"  # in the worktree
    options = [f"--rate={args.rate}", f"--duration={args.duration}", f"--large-share={args.large_share}"]
    options += [f"--max-replicas={args.max_replicas}", f"--large-s={args.large_s}", f"--seed={args.seed}"]
    if "--rounds" in (tree / "bench" / "encoder_scaling.py").read_text():  # a bench with baselines of its own
        options += ["--baseline=none", "--rounds=1"]
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    command = [sys.executable, "-m", "bench.encoder_scaling", "--configs=count,cost", f"--out={out}", *options]
    subprocess.run(command, cwd=tree, env=env, check=True)
    lines = (tree / out).read_text().splitlines()
    return sha, [Row.parse(line, sha) for line in lines if line.startswith(("count ", "cost "))]


@dataclass
class Round:
    """One pass of the configurations now and of the baseline's, in the order A B, B A, ..."""

    runs: list[Run]
    baseline: tuple[str, list[Row]] = ("", [])


def report(rounds: list[Round], load: list[Request], args: argparse.Namespace) -> str:
    n_large = sum(r.large for r in load)
    sha = next((rd.baseline[0] for rd in rounds if rd.baseline[0]), "")
    several = len(rounds) > 1

    def named(row: Row, k: int) -> str:
        return (replace(row, name=f"{row.name} #{k}") if several else row).format()

    lines = [
        f"encoder scaling: {len(load)} requests ({n_large} large) over {args.duration:g} s at {args.rate:g}/s, "
        f"seed {args.seed}, 1-{args.max_replicas} Encoder replicas, ViT {args.large_s:g} s per 1 MP photo"
        + (f"; baseline: main at {sha} (its own code and bench, the same load)" if sha else "")
        + (f"; {len(rounds)} rounds, baseline and now in the order A B, B A, ..." if several else ""),
        "",
        HEADER,
    ]
    for k, rd in enumerate(rounds, 1):
        lines += [named(row, k) for row in rd.baseline[1]] + [named(Row.of(r), k) for r in rd.runs]
    if several:  # each configuration's rows averaged over the rounds: what one round's noise does not decide
        by_name: dict[str, list[Row]] = {}
        for rd in rounds:
            for row in [*rd.baseline[1], *(Row.of(r) for r in rd.runs)]:
                by_name.setdefault(row.name, []).append(row)
        lines += [""] + [Row.mean(rows).format() for rows in by_name.values()]
    lines += [
        "",
        "replicas that started during the run (seconds after the step; a start is from the policy's decision to the "
        "replica's first image, split into the phases the replica measured, the part of each after the decision):",
    ]
    for k, rd in enumerate(rounds, 1):
        for r in rd.runs:
            label = f"{r.name} #{k}" if several else r.name
            for n, (asked, at, start) in enumerate(r.new_starts(), 2):
                whole = f"{sum(start.phases.values()):.1f} s from its process's start"
                if asked is None:
                    lines.append(f"  {label:<12} #{n}: asked -, serving {at:.1f}: {whole}")
                    continue
                after = start.after(r.began + asked)
                phases = ", ".join(f"{p.replace('_', ' ')} {s:.1f}" for p, s in after.items())
                span = f"start {at - asked:.1f} s ({phases}; {whole})"
                lines.append(f"  {label:<12} #{n}: asked {asked:.1f}, serving {at:.1f}: {span}")
    by = [{r.name: r for r in rd.runs} for rd in rounds]
    if all("count" in b and "cost" in b for b in by):
        ratio = [b["count"].pct(0.99) / b["cost"].pct(0.99) for b in by]
        seconds = [b["cost"].replica_seconds() / b["count"].replica_seconds() for b in by]
        lines += [
            "",
            f"encoder scaling: p99 image TTFT count/cost = {_spread(ratio)}, replica-seconds cost/count = "
            f"{_spread(seconds)}",
        ]
    thens = [next((row for row in rd.baseline[1] if row.name.startswith("count@")), None) for rd in rounds]
    if all(t is not None for t in thens):
        if all("cost" in b for b in by):
            nows = [b["cost"] for b in by]
            spans = [span for r in nows for span in r.start_spans()]
            start = statistics.median(spans) if spans else None  # of every round's starts
            before_p99, now_p99 = [t.p99 for t in thens], [n.pct(0.99) for n in nows]  # type: ignore[union-attr]
            before_s, now_s = [t.replica_s for t in thens], [n.replica_seconds() for n in nows]  # type: ignore[union-attr]
            if several:
                lines.append(
                    "rounds, p99 image TTFT before/now: "
                    + ", ".join(f"{b / n:.2f}x ({b:.1f} / {n:.1f} s)" for b, n in zip(before_p99, now_p99, strict=True))
                )
            lines.append(
                f"encoder scaling: start {'-' if start is None else format(start, '.1f')}s; p99 image TTFT "
                f"before/now {statistics.mean(before_p99) / statistics.mean(now_p99):.2f}x; replica-seconds "
                f"now/before {statistics.mean(now_s) / statistics.mean(before_s):.2f}x"
            )
    return "\n".join(lines)


def _spread(xs: list[float]) -> str:
    """One ratio, or a round's each and their mean."""
    if len(xs) == 1:
        return f"{xs[0]:.2f}x"
    return f"{statistics.mean(xs):.2f}x (" + ", ".join(f"{x:.2f}x" for x in xs) + ")"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second after the step")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--large-share", type=float, default=0.2, help="share of 1-4 MP photos")
    parser.add_argument("--max-replicas", type=int, default=4)
    parser.add_argument("--large-s", type=float, default=1.0, help="the slowed ViT's time for a 1 MP photo")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", default=BASELINE, help="a commit to run the same load on first; 'none': skip")
    parser.add_argument("--rounds", type=int, default=4, help="passes of the baseline and now, A B, B A, ...")
    parser.add_argument("--out", type=Path, default=Path("bench_results/encoder-scaling.txt"))
    args = parser.parse_args(argv)
    checkpoint = bench_checkpoint(Path("bench_results/checkpoints"), CHECKPOINT)
    spec = ModelSpec.load(checkpoint, device="cpu")
    args.seconds_per_gflop = args.large_s / spec.image_cost.gflop(spec.processing.grid_thw(1024, 1024))
    load = workload(args.rate, args.duration, args.large_share, args.seed)

    def now() -> list[Run]:
        metrics_port = free_port()
        with ray_serve(metrics_port=metrics_port) as port:
            return [measure(name, port, checkpoint, load, args, metrics_port) for name in args.configs.split(",")]

    rounds = []
    for k in range(args.rounds):  # the baseline and now in the order A B, B A, ...: a drifting machine weighs both
        if args.baseline == "none":
            rounds.append(Round(now()))
        elif k % 2 == 0:
            baseline = baseline_rows(args.baseline, args)
            rounds.append(Round(now(), baseline))
        else:
            runs = now()
            rounds.append(Round(runs, baseline_rows(args.baseline, args)))
    text = report(rounds, load, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
