"""`make bench-peer`'s workloads and its printed report: one markdown table per system, the prompt-length check, and
the ratios ours / vLLM last."""

from __future__ import annotations

from dataclasses import dataclass

SYSTEMS = ("ours", "vllm")
NAMES = {"ours": "ours", "vllm": "vLLM"}


@dataclass(frozen=True, slots=True)
class PeerWorkload:
    key: str
    sizes: tuple[tuple[int, int], ...]  # (width, height) of each image, in the order they are sent
    output_len: int  # exact: ignore_eos, no range

    @property
    def label(self) -> str:
        spelled = [f"{w}x{h}" for w, h in self.sizes]
        images = f"1 image {spelled[0]}" if len(spelled) == 1 else f"{len(spelled)} images ({', '.join(spelled)})"
        return f"{images}, {self.output_len} out"


# The three of issue 18: image-heavy, several images of mixed sizes, decode-heavy.
WORKLOADS = (PeerWorkload("a", ((224, 224),), 64),
             PeerWorkload("b", ((224, 224), (160, 112), (96, 96)), 64),
             PeerWorkload("c", ((112, 112),), 256))  # fmt: skip


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def figures(runs: dict[int, dict], hi: int, lo: int) -> dict[str, float | None]:
    """The table's numbers from one system's runs of one workload ({concurrency: aggregate})."""
    high, low = runs.get(hi), runs.get(lo)
    return {
        "tok_s_hi": high and high["out_tok_per_s"],
        "tok_s_lo": low and low["out_tok_per_s"],
        "tpot_p50_hi": high and high["tpot_ms"]["p50"],
        "tpot_p99_hi": high and high["tpot_ms"]["p99"],
        "ttft_p50_hi": high and high["ttft_ms"]["p50"],
        "tpot_p50_lo": low and low["tpot_ms"]["p50"],
    }


def system_table(runs: dict[str, dict[int, dict]], workloads: list[PeerWorkload], hi: int, lo: int) -> list[str]:
    """One system's markdown table ({workload key: {concurrency: aggregate}}), then any failures."""
    lines = [
        f"| workload | c={hi} output tok/s | c={lo} tok/s | c={hi} TPOT p50/p99 ms | c={hi} TTFT p50 ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    notes = []
    for w in workloads:
        f = figures(runs.get(w.key, {}), hi, lo)
        lines.append(
            f"| {w.label} | {_num(f['tok_s_hi'])} | {_num(f['tok_s_lo'])} | "
            f"{_num(f['tpot_p50_hi'])} / {_num(f['tpot_p99_hi'])} | {_num(f['ttft_p50_hi'])} |"
        )
        for c, agg in sorted(runs.get(w.key, {}).items(), reverse=True):
            problems = [f"{n} x {msg}" for msg, n in agg["errors"].items()] + list(agg.get("warnings", []))
            if agg["short_outputs"]:
                problems.append(f"{agg['short_outputs']} output(s) shorter than max_tokens")
            notes += [f"  {w.key} c={c}: {p}" for p in problems]
    return lines + notes


def ratios(
    results: dict[str, dict[str, dict[int, dict]]], workloads: list[PeerWorkload], hi: int, lo: int
) -> dict[str, dict[str, float | None]]:
    """ours / vLLM per workload: throughput at hi (above 1 is better), TPOT p50 at lo and TTFT p50 at hi (below 1 is
    better)."""
    out = {}
    for w in workloads:
        ours = figures(results.get("ours", {}).get(w.key, {}), hi, lo)
        peer = figures(results.get("vllm", {}).get(w.key, {}), hi, lo)
        out[w.key] = {key: _ratio(ours[key], peer[key]) for key in ("tok_s_hi", "tpot_p50_lo", "ttft_p50_hi")}
    return out


def ratio_lines(r: dict[str, dict[str, float | None]], workloads: list[PeerWorkload], hi: int, lo: int) -> list[str]:
    lines = [
        f"| workload | c={hi} tok/s ours/vLLM (>1: ours faster) | c={lo} TPOT p50 ours/vLLM (<1: ours faster) "
        f"| c={hi} TTFT p50 ours/vLLM (<1: ours faster) |",
        "| --- | --- | --- | --- |",
    ]
    lines += [
        f"| {w.label} | {_x(r[w.key]['tok_s_hi'])} | {_x(r[w.key]['tpot_p50_lo'])} | {_x(r[w.key]['ttft_p50_hi'])} |"
        for w in workloads
    ]
    ks = [w.key for w in workloads]
    summary = (
        f"peer: c={hi} tok/s ours/vLLM = {', '.join(_x(r[k]['tok_s_hi']) for k in ks)}; "
        f"c={lo} TPOT ours/vLLM = {', '.join(_x(r[k]['tpot_p50_lo']) for k in ks)}; "
        f"c={hi} TTFT p50 ours/vLLM = {', '.join(_x(r[k]['ttft_p50_hi']) for k in ks)}"
    )
    return lines + ["", summary]


def prompt_check(
    records: dict[str, dict[str, dict[int, list[dict]]]], workloads: list[PeerWorkload]
) -> tuple[bool, str]:
    """Both systems must count the same prompt tokens (usage.prompt_tokens) for every request both completed."""
    parts, ok = [], True
    for w in workloads:
        seen: dict[str, dict[tuple[int, int], int]] = {}
        for system in SYSTEMS:
            by_c = records.get(system, {}).get(w.key, {})
            seen[system] = {(c, r["index"]): r["prompt_tokens"] for c, rs in by_c.items() for r in rs if r["ok"]}
        both = sorted(seen["ours"].keys() & seen["vllm"].keys())
        bad = {k: (seen["ours"][k], seen["vllm"][k]) for k in both if seen["ours"][k] != seen["vllm"][k]}
        if not both or bad:
            ok = False
        counts = sorted({seen["ours"][k] for k in both})
        span = f"{counts[0]}" if len(counts) == 1 else (f"{counts[0]}-{counts[-1]}" if counts else "-")
        parts.append(
            f"{w.key}: {len(both) - len(bad)}/{len(both)} equal ({span} tokens)"
            + (f", MISMATCH (c, request): (ours, vLLM) {bad}" if bad else "")
        )
    verdict = "equal for both systems" if ok else "NOT equal for both systems (or not compared)"
    return ok, f"prompt tokens (usage.prompt_tokens) {verdict}: " + "; ".join(parts)
