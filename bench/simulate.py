"""Virtual-clock replay of a FIFO server that runs batches of up to B requests, fed by the bench's clients.

The transformers baselines have no server: we time each batch for real (in-process, one at a time) and place
it on a virtual clock, so a request's latency includes the time it would have queued behind earlier batches.
The clients are the same as against our server: at most `concurrency` requests in flight; request i is sent at
its arrival time (0 in a closed loop, Poisson otherwise) or, if later, when request i - concurrency completes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bench.metrics import RequestResult


@dataclass(slots=True)
class Timing:
    """One request's measured service, in seconds from the start of its batch."""

    token_times: list[float]  # when each of its own output tokens was ready
    end: float  # when its response is complete (for a static batch: when the whole batch is)
    prompt_tokens: int


# Runs (or looks up) one batch of request indices; returns per-request timings and how long the batch took.
ServeBatch = Callable[[list[int]], tuple[list[Timing], float]]


def simulate(
    n: int,
    concurrency: int,
    max_batch: int,
    serve_batch: ServeBatch,
    expected: list[int],
    arrivals: list[float] | None = None,
) -> tuple[list[RequestResult], float]:
    """Replay n requests; returns results in request order and the wall time (0 -> last completion).

    Completions are FIFO in request order (one batch at a time, a batch's requests in order), so send times are
    non-decreasing, the waiting requests are always a prefix of the unserved ones, and when nothing waits the
    next request's send time is already known.
    """
    base = arrivals if arrivals is not None else [0.0] * n
    send: list[float | None] = [base[i] if i < concurrency else None for i in range(n)]
    results: list[RequestResult | None] = [None] * n
    clock, head = 0.0, 0  # the server's free time; the first unserved request
    while head < n:
        if send[head] > clock:  # idle server: jump to the next send
            clock = send[head]
        batch = [head]
        while (
            len(batch) < max_batch
            and batch[-1] + 1 < n
            and send[batch[-1] + 1] is not None
            and send[batch[-1] + 1] <= clock
        ):
            batch.append(batch[-1] + 1)
        timings, duration = serve_batch(batch)
        for i, t in zip(batch, timings, strict=True):
            wait = clock - send[i]
            gaps = [b - a for a, b in zip(t.token_times, t.token_times[1:])]
            results[i] = RequestResult(
                i,
                ok=True,
                sent=send[i],
                ttft=wait + t.token_times[0],
                e2e=wait + t.end,
                itls=gaps,
                output_tokens=len(t.token_times),
                prompt_tokens=t.prompt_tokens,
                expected_tokens=expected[i],
                chunks=len(t.token_times),
            )
            if i + concurrency < n:  # that client's next request
                send[i + concurrency] = max(base[i + concurrency], send[i] + wait + t.end)
        clock += duration
        head = batch[-1] + 1
    wall = max(r.sent + r.e2e for r in results)
    return list(results), wall
