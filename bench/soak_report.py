"""The soak's report (bench/soak.py): outcomes by category, then every sampled measure round by round, its change
and its fitted growth per 1,000 requests over the second half of the load, then the bounds and what broke them."""

from __future__ import annotations

from typing import Any

from bench.soak_probe import upstream

MIB = 1 << 20
MAX_COLUMNS = 6  # rounds shown; the fit uses every round


def _shown_rounds(rounds: int) -> list[int]:
    step = -(-rounds // MAX_COLUMNS)
    return sorted({*range(step, rounds + 1, step), rounds})


def report(r: Any) -> str:
    """`r`: a bench.soak.SoakResult."""
    lines = [
        f"soak: {r.requests} requests, concurrency {r.concurrency}, seed {r.seed}: {r.elapsed_s:.1f}s "
        f"({r.requests / r.elapsed_s:.1f} req/s), {r.rounds} rounds",
        "",
        f"{'category':<9}{'count':>6}{'fail':>6}{'p50 ms':>9}{'p99 ms':>9}  statuses",
    ]
    for category, s in r.summary().items():
        statuses = " ".join(f"{k}:{v}" for k, v in s["statuses"].items())
        lines.append(
            f"{category:<9}{s['count']:>6}{s['failures']:>6}{s['p50_ms']:>9.0f}{s['p99_ms']:>9.0f}  {statuses}"
        )
    shown = [0, *_shown_rounds(r.rounds), r.rounds + 1]  # indices into r.samples
    columns = ["before", *(f"{k * r.requests // r.rounds}" for k in shown[1:-1]), "settled"]
    lines += ["", f"{'measure':<30}" + "".join(f"{c:>9}" for c in columns) + f"{'delta':>9}{'per 1k':>9}"]

    def row(name: str, get, unit: float = 1.0, fmt: str = ".1f") -> None:
        values = [get(r.samples[i]) for i in shown]
        cells = "".join(f"{'-' if v is None else format(v / unit, fmt):>9}" for v in values)
        if None in (values[0], values[-1]):  # a replica the encoder autoscaler started or stopped meanwhile
            lines.append(f"{name:<30}{cells}{'new' if values[0] is None else 'gone':>9}")
            return
        slope = r.slope(get)
        per_1k = "-" if slope is None else format(slope / unit, "+.2f")
        lines.append(f"{name:<30}{cells}{(values[-1] - values[0]) / unit:>+9{fmt}}{per_1k:>9}")

    for name in sorted({n for s in r.samples for n in s["rss"]}):
        row(f"RSS {name} MiB", lambda s, n=name: s["rss"].get(n), MIB)
    for name in sorted({n for s in r.samples for n in s.get("objects", {})}):  # a leak grows these with the RSS
        row(f"objects {name} k", lambda s, n=name: s.get("objects", {}).get(n), 1000)
    row("object store MiB", lambda s: s["store"]["bytes"], MIB, ".2f")
    row("object store objects", lambda s: s["store"]["objects"], fmt=".0f")
    for key in ("running", "waiting", "kv_usage", "cancelled", "finished", "failed", "preemptions", "prefix_hits"):
        row(f"engine {key}", lambda s, k=key: s["engine"][k], fmt=".4f" if key == "kv_usage" else ".0f")
    for key in ("entries", "bytes", "hits", "misses"):
        row(f"embedding cache {key}", lambda s, k=key: s["cache"][k], fmt=".0f")
    b = r.bounds
    slope = "" if b.max_rss_slope_mib_per_1k is None else f" and +{b.max_rss_slope_mib_per_1k:g} MiB per 1k requests"
    lines += [
        "",
        f"per 1k: least-squares growth per 1,000 requests over rounds {r.rounds // 2}..{r.rounds}",
        f"logs: {len(r.logs)} ERROR lines or tracebacks in the app's replica and proxy logs and replica stderr during "
        f"the load ({sum(map(upstream, r.logs))} of them Ray Serve's own, not counted)",
        f"settled in {r.settle_s:.1f}s; bounds: RSS +{b.max_rss_growth_mib:g} MiB per replica{slope}, "
        f"object store +{b.max_object_store_growth_mib:g} MiB, no sequence or KV block held, clean logs",
    ]
    lines += [f"VIOLATION {v}" for v in r.violations[:50]] or ["all bounds held"]
    return "\n".join(lines)


__all__ = ["MIB", "report"]
