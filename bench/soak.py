"""A bounded soak: thousands of mixed requests (good, bad, cancelled, streaming) against the app, then its leaks.

`python -m bench.soak --requests 30000 --rounds 12 --concurrency 16` (`make soak`) starts the app here as `make bench`
does (tiny demo checkpoint, the end-to-end tests' small LIMITS, so bad inputs hit limits cheaply), behind the front
door `make serve` opens (`--ingress`, direct by default: the Ingress replica's own port, where a request a client
leaves has its calls cancelled with it; tests/test_bench_soak.py soaks Serve's proxy);
`--url http://127.0.0.1:8000 --app vlm` drives one already running (this process then joins its Ray cluster,
which must be on this machine: replica memory is read from /proc). tests/test_bench_soak.py runs a short one.

The mix (seeded; bench/soak_mix.py): ~35% good non-streaming (text, one or two PNGs of varied sizes, mostly from a
small pool so the embedding and prefix caches hit, sometimes n=2, stop, logprobs, unknown fields), ~25% good
streaming (read to `data: [DONE]`), ~15% cancelled (a stream closed after its first content chunk or after a short
delay, a non-streaming request dropped by a short client timeout), ~25% bad (19 kinds in turn, each with the 4xx it
must get). `max_tokens` is 4-16, except on cancelled requests, which ask for 64-256 tokens with `ignore_eos` so that
they are still generating when the client leaves.

Bounds (each a flag); a broken one exits non-zero:
- no 5xx at all (a 503 too: keep 2 x concurrency below the engine's `max_queued_requests`, 64 by default,
  n=2 requests put two sequences in its queue), no error event in a 200 stream, every good request a 200 and
  every bad one its own 4xx;
- each replica's (and the HTTP proxy's) resident memory grows by at most `--max-rss-growth-mib` (150) from a
  sample taken after `--warmup` requests to one taken after the load has settled; an Ingress may also grow by the
  bytes its embedding cache holds (its refs of embeddings under Ray's inline limit live in its memory; bounded by
  `encoder.cache_gib`, by design);
- each replica's growth fitted by least squares over the second half of the `--rounds` (a leak goes on at a steady
  rate; warm-up and fragmentation level off) at most `--max-rss-slope-mib-per-1k` (2) MiB per 1,000 requests; beside
  it, the Python objects each replica made since it started (a leak grows them too, fragmentation does not);
- object store bytes in use after settling at most `--max-object-store-growth-mib` (10) above the first sample, plus
  what the ingress's embedding cache holds there by design (bounded by `encoder.cache_gib`);
- after settling (polled for up to `--settle-s`, 10 s): no sequence running or waiting in the engine and no KV
  block held by a sequence (`kv_usage` counts blocks with a reference; cached-but-free prefix blocks are free);
- no ERROR line or traceback in the app's replica logs, the proxy's, or its replica processes' stderr during the load
  (a client's error is a WARNING line at most); Ray Serve's own router errors (`UPSTREAM`, with no frame of ours in
  the traceback) are counted apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.soak_mix import MIX, Mix, Outcome, drive
from bench.soak_probe import log_problems, sample, serve_logs, upstream
from bench.soak_report import MIB, report

__all__ = ["Bounds", "Mix", "SoakResult", "check", "report", "soak"]


def _rss_less_cache(s: dict, name: str) -> int | None:
    """A replica's resident bytes, less what the Ingress's embedding cache holds by design (bounded by
    encoder.cache_gib)."""
    rss = s["rss"].get(name)
    return rss - s["cache"]["bytes"] if rss is not None and name.startswith("Ingress#") else rss


def _store_growth(s: dict, before: dict) -> int:
    """Object store bytes in use above `before`, less what the embedding cache holds there by design."""
    return s["store"]["bytes"] - before["store"]["bytes"] - max(0, s["cache"]["bytes"] - before["cache"]["bytes"])


def _drained(s: dict, before: dict, max_store: int) -> bool:
    e = s["engine"]
    return e["running"] == e["waiting"] == 0 and e["kv_usage"] == 0 and _store_growth(s, before) <= max_store


# ---- The soak -----------------------------------------------------------------------------------------------------


@dataclass
class Bounds:
    max_rss_growth_mib: float = 150
    max_object_store_growth_mib: float = 10
    settle_s: float = 10
    # Growth over the second half of the rounds, fitted: a leak goes on at a steady rate, warm-up and fragmentation
    # level off. None: not checked (a short soak's rounds are too small to fit).
    max_rss_slope_mib_per_1k: float | None = None
    log_problems: bool = True  # any ERROR line or traceback in the app's replica and proxy logs is a violation


@dataclass
class SoakResult:
    requests: int
    concurrency: int
    seed: int
    elapsed_s: float
    outcomes: list[Outcome]
    samples: list[dict]  # before the load, after each round of it (the last: after the load), settled
    settle_s: float
    bounds: Bounds
    logs: list[str] = field(default_factory=list)  # ERROR lines and tracebacks logged during the load
    violations: list[str] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.samples) - 2

    def slope(self, get) -> float | None:
        """Least-squares growth of `get(sample)` per 1,000 requests over the second half of the rounds (the
        samples after rounds//2 .. all rounds); None when a value is missing there or fewer than 3 points."""
        ks = range(self.rounds // 2, self.rounds + 1)
        points = [(k * self.requests / self.rounds, get(self.samples[k])) for k in ks]
        if len(points) < 3 or any(v is None for _, v in points):
            return None
        mx, my = sum(x for x, _ in points) / len(points), sum(v for _, v in points) / len(points)
        sxx = sum((x - mx) ** 2 for x, _ in points)
        return 1000 * sum((x - mx) * (v - my) for x, v in points) / sxx

    @property
    def before(self) -> dict:
        return self.samples[0]

    @property
    def settled(self) -> dict:
        return self.samples[-1]

    def summary(self) -> dict[str, dict]:
        out = {}
        for category in MIX:
            rows = [o for o in self.outcomes if o.category == category]
            lat = sorted(o.latency_s for o in rows) or [0.0]
            pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]  # noqa: E731
            out[category] = {
                "count": len(rows),
                "statuses": dict(sorted(Counter(o.status for o in rows).items())),
                "p50_ms": 1000 * pct(0.5),
                "p99_ms": 1000 * pct(0.99),
                "failures": sum(not o.ok for o in rows),
            }
        return out

    def to_json(self) -> dict:
        return {**asdict(self), "summary": self.summary()}


def check(result: SoakResult) -> list[str]:
    b, before, settled = result.bounds, result.before, result.settled
    out = [f"{o.category}/{o.kind}: {o.status} ({o.detail})" for o in result.outcomes if not o.ok]
    for name, rss in settled["rss"].items():
        if name not in before["rss"]:
            continue  # a replica started during the load (encoder autoscaling): no baseline
        allowed = b.max_rss_growth_mib * MIB
        if name.startswith("Ingress#"):  # its embedding cache fills by design, up to encoder.cache_gib
            allowed += max(0, settled["cache"]["bytes"] - before["cache"]["bytes"])
        if rss - before["rss"][name] > allowed:
            out.append(f"{name}: RSS grew {(rss - before['rss'][name]) / MIB:.0f} MiB, over {allowed / MIB:.0f}")
        slope = result.slope(lambda s, n=name: _rss_less_cache(s, n))
        if b.max_rss_slope_mib_per_1k is not None and slope is not None and slope > b.max_rss_slope_mib_per_1k * MIB:
            out.append(
                f"{name}: RSS still growing {slope / MIB:.2f} MiB per 1000 requests over the second half, over "
                f"{b.max_rss_slope_mib_per_1k:g}"
            )
    grown = _store_growth(settled, before)
    if grown > b.max_object_store_growth_mib * MIB:
        out.append(
            f"object store: {grown / MIB:.1f} MiB more in use after settling, over "
            f"{b.max_object_store_growth_mib:g} MiB ({settled['store']['objects']} objects)"
        )
    e = settled["engine"]
    if e["running"] or e["waiting"] or e["kv_usage"]:
        out.append(
            f"engine after {result.settle_s:.1f}s: {e['running']} running, {e['waiting']} waiting, "
            f"kv_usage {e['kv_usage']:.6f} (blocks still held by sequences)"
        )
    if b.log_problems:
        out += [f"log: {line}" for line in result.logs if not upstream(line)]
    return out


def soak(
    base_url: str,
    app: str,
    *,
    requests: int,
    concurrency: int = 8,
    seed: int = 0,
    warmup: int = 50,
    rounds: int = 4,
    bounds: Bounds | None = None,
) -> SoakResult:
    """Warm up, sample, drive the load in `rounds` (a sample after each: growth that goes on round after round is a
    leak, growth that stops is warm-up or fragmentation), let it settle, sample, read the logs; `violations` lists
    every broken bound."""
    bounds = bounds or Bounds()
    mix = Mix(seed, model=httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"])
    asyncio.run(drive(base_url, mix.cases(warmup, offset=requests), concurrency))  # not counted
    cases, outcomes, samples, elapsed = mix.cases(requests), [], [sample(app)], 0.0
    logs = serve_logs(app)
    for k in range(rounds):
        start = time.monotonic()
        chunk = cases[k * requests // rounds : (k + 1) * requests // rounds]
        outcomes += asyncio.run(drive(base_url, chunk, concurrency))
        elapsed += time.monotonic() - start
        samples.append(sample(app))
    settled, t0 = samples[-1], time.monotonic()
    while (
        not _drained(settled, samples[0], bounds.max_object_store_growth_mib * MIB)
        and time.monotonic() - t0 < bounds.settle_s
    ):
        time.sleep(0.25)
        settled = sample(app)
    result = SoakResult(
        requests, concurrency, seed, elapsed, outcomes, [*samples, settled], time.monotonic() - t0, bounds
    )
    result.logs = log_problems(logs, app)
    result.violations = check(result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=30000)
    parser.add_argument("--concurrency", type=int, default=16, help="at most 32 (the engine queue holds 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=50, help="requests before the first sample (not counted)")
    parser.add_argument("--rounds", type=int, default=12, help="samples during the load, one after each round")
    parser.add_argument("--url", help="an app already running (default: start one here)")
    parser.add_argument("--app", default="vlm", help="its Serve application name, with --url")
    parser.add_argument(
        "--ingress",
        default="direct",
        choices=["direct", "proxy", "haproxy"],
        help="the front door of the app started here (default: direct, as `make serve`)",
    )
    parser.add_argument("--max-rss-growth-mib", type=float, default=Bounds.max_rss_growth_mib)
    parser.add_argument("--max-object-store-growth-mib", type=float, default=Bounds.max_object_store_growth_mib)
    parser.add_argument("--settle-s", type=float, default=Bounds.settle_s)
    parser.add_argument(
        "--max-rss-slope-mib-per-1k", type=float, default=2.0, help="bound on each replica's fitted growth"
    )
    parser.add_argument("--json", type=Path, help="write the result (every request) here")
    args = parser.parse_args(argv)
    if not 1 <= args.concurrency <= 32:
        parser.error("--concurrency must be 1..32: past it, n=2 requests can fill the engine queue (503s)")
    if args.rounds < 1 or args.requests < args.rounds:
        parser.error("--rounds must be 1..--requests")
    bounds = Bounds(
        args.max_rss_growth_mib, args.max_object_store_growth_mib, args.settle_s, args.max_rss_slope_mib_per_1k
    )

    def run(url: str, app: str) -> SoakResult:
        return soak(
            url,
            app,
            requests=args.requests,
            concurrency=args.concurrency,
            seed=args.seed,
            warmup=args.warmup,
            rounds=args.rounds,
            bounds=bounds,
        )

    if args.url:
        import ray

        ray.init(address="auto", logging_level="warning")
        result = run(args.url, args.app)
    else:
        from bench.server import serve_app
        from demo.build_tiny import main as build_tiny
        from demo.local import LIMITS

        build_tiny(["--out", "demo/qwen2-vl-tiny"])  # as `make checkpoint`: a no-op when it is there
        with serve_app(
            Path("demo/qwen2-vl-tiny"),
            max_images=4,
            overrides={"limits": LIMITS, "llm": {"max_model_len": 1024}},
            ingress=args.ingress,
        ) as url:
            result = run(url, "bench")
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result.to_json(), indent=1))
    return 1 if result.violations else 0


if __name__ == "__main__":
    sys.exit(main())
