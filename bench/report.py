"""The report: machine facts, one table per concurrency, ratios, the TPOT check; JSON and a PNG on disk."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
from pathlib import Path

SYSTEMS = ("ours", "ours-in-process", "hf-one-at-a-time", "hf-static-batch")
OURS, BASELINES = SYSTEMS[:2], SYSTEMS[2:]
COLUMNS = [("req/s", "req_per_s", None), ("out tok/s", "out_tok_per_s", None),
           ("TTFT p50", "ttft_ms", "p50"), ("TTFT p99", "ttft_ms", "p99"),
           ("TPOT p50", "tpot_ms", "p50"), ("TPOT p99", "tpot_ms", "p99"),
           ("ITL p50", "itl_ms", "p50"), ("ITL p99", "itl_ms", "p99"), ("tok/chunk", "tokens_per_chunk", None),
           ("E2E p50", "e2e_ms", "p50"), ("E2E p99", "e2e_ms", "p99"),
           ("goodput", "goodput_req_per_s", None), ("failed", "failed", None),
           # ours only: LLM-replica messages (own streams + channels) per output token, and out tok/s served over
           # out tok/s of the same engine in-process on the same requests
           ("msg/tok", "messages_per_token", None), ("/in-proc", "served_over_in_process", None)]  # fmt: skip


def machine_info() -> dict:
    import ray
    import torch
    import transformers

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        # other work on the machine skews every figure: a 1-minute load well above 0 before we start says so
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ray": ray.__version__,
    }


def _cell(agg: dict, key: str, sub: str | None) -> str:
    value = agg.get(key) if sub is None else agg[key][sub]
    if value is None:
        return "-"
    if key in ("messages_per_token", "served_over_in_process"):
        return f"{value:.3f}" if key == "messages_per_token" else f"{value:.2f}x"
    if key == "failed":
        return f"{value}/{agg['requests']}"
    if key == "tokens_per_chunk":
        return f"{value:.1f}"
    return f"{value:.2f}" if key.endswith("per_s") else f"{value:.0f}"


def format_tables(runs: dict[str, dict[int, dict]], concurrencies: list[int], mode: str) -> str:
    """One table per concurrency (latencies in ms), then ratios and the TPOT check."""
    lines = []
    width = max(len(s) for s in SYSTEMS)
    head = f"{'system':<{width}} " + " ".join(f"{name:>10}" for name, _, _ in COLUMNS)
    for c in concurrencies:
        lines += [
            "",
            f"concurrency {c} ({mode}); latencies in ms (ITL per token-carrying chunk), goodput in req/s "
            "meeting both SLOs",
            head,
            "-" * len(head),
        ]
        for system in SYSTEMS:
            agg = runs.get(system, {}).get(c)
            if agg is not None:
                lines.append(f"{system:<{width}} " + " ".join(f"{_cell(agg, k, s):>10}" for _, k, s in COLUMNS))
                note = agg.get("note")
                if note:
                    lines.append(f"{'':<{width}}   ({note})")
        for system in SYSTEMS:
            agg = runs.get(system, {}).get(c)
            if agg and agg["errors"]:
                lines += [f"  {system} failures: {n} x {msg}" for msg, n in agg["errors"].items()]
            if agg and agg.get("warnings"):
                lines += [f"  {system} warning: {msg}" for msg in agg["warnings"]]
    lines += ["", "output tok/s ratios (ours / baseline):"]
    for c in concurrencies:
        for mine in OURS:
            ours = runs.get(mine, {}).get(c)
            parts = []
            for base in BASELINES:
                other = runs.get(base, {}).get(c)
                if ours and other and other["out_tok_per_s"] > 0:
                    parts.append(f"/ {base} = {ours['out_tok_per_s'] / other['out_tok_per_s']:.2f}x")
            if parts:
                lines.append(f"  c={c} {mine:<15} " + "  ".join(parts))
    lines += ["", "the served path (ours) against the same engine in-process, and its LLM-replica messages:"]
    for c in concurrencies:
        agg = runs.get("ours", {}).get(c)
        if agg and agg.get("llm_messages") is not None:
            ratio, rate = agg.get("served_over_in_process"), agg.get("messages_per_token")
            lines.append(
                f"  c={c}: served / in-process out tok/s = "
                + ("-" if ratio is None else f"{ratio:.2f}x")
                + f"; {agg['llm_messages']} messages, "
                + ("-" if rate is None else f"{rate:.3f}")
                + " per output token"
            )
    lines += [
        "",
        f"TPOT check: p99 TPOT at c={max(concurrencies)} / p50 TPOT at c={min(concurrencies)} "
        "(1.0 = no slowdown under load):",
    ]
    for system, check in tpot_check(runs, concurrencies).items():
        lines.append(f"  {system:<{width}} " + ("-" if check is None else f"{check:.2f}x"))
    return "\n".join(lines)


def tpot_check(runs: dict[str, dict[int, dict]], concurrencies: list[int]) -> dict[str, float | None]:
    lo, hi = min(concurrencies), max(concurrencies)
    out = {}
    for system in SYSTEMS:
        by_c = runs.get(system, {})
        if lo in by_c and hi in by_c:
            p50, p99 = by_c[lo]["tpot_ms"]["p50"], by_c[hi]["tpot_ms"]["p99"]
            out[system] = p99 / p50 if p50 and p99 is not None else None
    return out


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))


def plot(path: Path, runs: dict[str, dict[int, dict]], title: str) -> None:
    """Two panels: output tok/s and p99 TPOT against concurrency, one line per system."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on the bench machine
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system in SYSTEMS:
        by_c = runs.get(system, {})
        cs = sorted(by_c)
        if not cs:
            continue
        left.plot(cs, [by_c[c]["out_tok_per_s"] for c in cs], marker="o", label=system)
        tpot = [(c, by_c[c]["tpot_ms"]["p99"]) for c in cs if by_c[c]["tpot_ms"]["p99"] is not None]
        right.plot([c for c, _ in tpot], [v for _, v in tpot], marker="o", label=system)
    ticks = sorted({c for by_c in runs.values() for c in by_c})
    for ax, ylabel in ((left, "output tokens / s"), (right, "p99 TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    right.set_ylim(bottom=0)
    left.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
