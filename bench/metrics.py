"""Per-request results and their aggregate (percentiles, rates, goodput), the same for every system."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestResult:
    index: int
    ok: bool
    sent: float  # s from the run's start, when the request went out (after the client's concurrency gate)
    ttft: float = 0.0  # s, send -> first chunk carrying tokens
    e2e: float = 0.0  # s, send -> end of the response
    itls: list[float] = field(default_factory=list)  # s, gaps between successive token-carrying chunks
    output_tokens: int = 0
    prompt_tokens: int = 0
    expected_tokens: int = 0  # what the request asked for (ignore_eos makes it exact)
    chunks: int = 0  # token-carrying chunks; a server that coalesces tokens sends fewer than output_tokens
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; undefined for one-token outputs."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    def to_json(self) -> dict:
        return {**asdict(self), "tpot": self.tpot}


def _summary(values: list[float]) -> dict[str, float | None]:
    """mean and p50/p90/p99 in ms (linear interpolation, as numpy and vllm bench serve do)."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=float) * 1000.0
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def aggregate(results: list[RequestResult], wall: float, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """One run's figures. Rates divide by the run's wall time (first send to last completion, from 0)."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    tpots = [r.tpot for r in done if r.tpot is not None]
    good = [r for r in done if r.ttft <= slo_ttft_s and (r.tpot is None or r.tpot <= slo_tpot_s)]
    out_tokens = sum(r.output_tokens for r in done)
    wall = max(wall, 1e-9)
    errors: dict[str, int] = {}
    for r in failed:
        key = (r.error or "unknown")[:200]
        errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(results), "completed": len(done), "failed": len(failed), "errors": errors,
        "warnings": sorted({r.error for r in done if r.error}),
        "short_outputs": sum(r.output_tokens != r.expected_tokens for r in done),
        "wall_s": wall, "req_per_s": len(done) / wall, "out_tok_per_s": out_tokens / wall,
        "goodput_req_per_s": len(good) / wall, "output_tokens": out_tokens,
        # ITL is per chunk (as vllm bench serve): read it with the tokens each chunk carried
        "tokens_per_chunk": out_tokens / max(1, sum(r.chunks for r in done)),
        "prompt_tokens_mean": float(np.mean([r.prompt_tokens for r in done])) if done else None,
        "ttft_ms": _summary([r.ttft for r in done]), "tpot_ms": _summary(tpots),
        "itl_ms": _summary([x for r in done for x in r.itls]), "e2e_ms": _summary([r.e2e for r in done]),
    }  # fmt: skip
