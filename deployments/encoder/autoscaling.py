"""The Encoder deployment's autoscaling policy: as many replicas as the encoder work pending and arriving needs.

Each Encoder replica reports, through Serve's custom autoscaling metrics (`record_autoscaling_stats`), the cost of
the images it has queued and running (encoders/cost.py, GFLOP), the cost that arrived at it over the last window
scaled to one target queueing delay (the leading signal: it rises with the arrival rate, before a queue builds), the
mean cost of an image it took, and the cost one replica should hold (`encoder.target_cost_per_replica`, by default
its measured GFLOP/s times `encoder.target_queue_delay_s`). Images the ingress could not place yet (every replica
at `max_ongoing_requests`) are Serve's own handle metric, `total_queued_requests`; they count at the mean cost.
Serve averages each metric over `look_back_period_s`, which follows a load step seconds late; the policy also reads
each replica's newest report (`raw_metrics`) and takes the larger of the two decisions: scale-up follows the newest
report, scale-down waits until the window's mean has come down too (and then Serve's `downscale_delay_s`). Both
decisions hold a band of `HYSTERESIS` of a replica's target around the count they have: up once the work exceeds the
replicas there are by that much, down once one replica fewer would still have that much to spare, so a steady load
near a boundary does not make the count flap with each report's noise.
Serve's controller runs `cost_policy` (it pickles this module by value: keep it free of the project's imports), then
applies min/max_replicas and upscale/downscale_delay_s as for its own policy. AUTOSCALING names it; without
`policy:` the Encoder scales on requests in flight, Serve's default."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

PENDING_COST = "pending_cost"  # GFLOP of encoder work queued and running on a replica
ARRIVING_COST = "arriving_cost"  # GFLOP arriving at a replica per target queueing delay (rate x delay)
MEAN_COST = "mean_cost"  # GFLOP of an image (or video chunk) a replica took, on average over the window
TARGET_COST = "target_cost"  # GFLOP of pending work one replica should hold
POLICY_PATH = "deployments.encoder.autoscaling:cost_policy"
PACED_POLICY_PATH = "deployments.encoder.autoscaling:paced_cost_policy"  # one replica starting at a time
# The Encoder deployment's autoscaling options (its decorator's; the KubeRay manifest raises max_replicas), tuned for
# reaction time rather than Ray's defaults (upscale 30 s, downscale 600 s, metrics every 10 s over 30 s): replicas
# report twice a second and a replica is asked for 0.5 s over target (seconds after a load step: a replica's
# start is the rest of the wait), and one goes 30 s after the load is gone.
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "policy": {"policy_function": POLICY_PATH},
    "upscale_delay_s": 0.5,
    "downscale_delay_s": 30,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 5,
}
WINDOW_S = 5.0  # the arrival meter's window: long enough to see a rate, short enough to follow a step
HYSTERESIS = 0.2  # of one replica's target: the band around the current count (module docstring)


class ArrivalMeter:
    """The cost that arrived over the last `window_s` seconds: its rate (GFLOP/s) and the mean cost of one arrival."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._arrivals: deque[tuple[float, float]] = deque()  # (when, cost)

    def add(self, cost: float) -> None:
        self._arrivals.append((self.clock(), cost))
        self._trim()

    def _trim(self) -> None:
        cutoff = self.clock() - self.window_s
        while self._arrivals and self._arrivals[0][0] < cutoff:
            self._arrivals.popleft()

    def rate(self) -> float:
        """The cost over the window. NOTE: over the whole window, not the time since its first arrival: that showed a
        step a second sooner, but a replica that had just started (its router's favourite, its meter a second old)
        then reported the load its peer's window still held as well, and a steady load scaled one replica too far
        (tests/deployments/test_encoder_autoscaling.py's steady load)."""
        self._trim()
        return sum(cost for _, cost in self._arrivals) / self.window_s

    def mean(self) -> float:
        self._trim()
        return sum(cost for _, cost in self._arrivals) / len(self._arrivals) if self._arrivals else 0.0


def desired_replicas(
    pending: dict[Any, float],
    targets: dict[Any, float],
    current: int,
    arriving: dict[Any, float] | None = None,
    queued_cost: float = 0.0,
    band: float = HYSTERESIS,
) -> int:
    """Enough replicas to drain what is waiting within the target delay, and to keep up with what arrives:
    need = max(pending + queued at the handles, arriving) in replicas' targets; more than `current` once need exceeds
    it by `band` (then ceil(need)), fewer once ceil(need + band) is fewer (none at no need at all; Serve keeps
    min_replicas). `current` while no replica has reported a target. The max, not the sum: work that arrived
    recently is also in `pending` while it waits."""
    target = max(targets.values(), default=0.0)
    if target <= 0:
        return current
    need = max(sum(pending.values()) + queued_cost, sum((arriving or {}).values())) / target
    if need > current + band:
        return math.ceil(need)
    return min(current, math.ceil(need + band)) if need > 0 else 0


def newest(raw: dict[str, dict[Any, list[Any]]]) -> dict[str, dict[Any, float]]:
    """Each replica's newest reported value of each metric, from Serve's raw time series (TimeStampedValue)."""
    return {
        name: {replica: max(series, key=lambda p: p.timestamp).value for replica, series in by.items() if series}
        for name, by in raw.items()
    }


def _decide(metrics: dict[str, dict[Any, float]], queued_requests: float, current: int) -> int:
    means = [m for m in metrics.get(MEAN_COST, {}).values() if m > 0]
    queued_cost = queued_requests * (sum(means) / len(means) if means else 0.0)
    return desired_replicas(
        metrics.get(PENDING_COST, {}),
        metrics.get(TARGET_COST, {}),
        current,
        metrics.get(ARRIVING_COST, {}),
        queued_cost,
    )


def cost_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Serve's `autoscaling_config.policy.policy_function` (an AutoscalingContext in; replicas and policy state
    out): the larger of the decisions on the window's means (Serve's aggregation over `look_back_period_s`) and on
    each replica's newest report."""
    queued, current = ctx.total_queued_requests or 0.0, ctx.target_num_replicas
    views = (ctx.aggregated_metrics or {}, newest(ctx.raw_metrics or {}))
    decisions = [_decide(metrics, queued, current) for metrics in views if metrics.get(TARGET_COST)]
    return (max(decisions) if decisions else current), {}


def paced_cost_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """`cost_policy`, asking for one replica more at a time: none while one it asked for is still starting (the
    target above the replicas running). For Encoder replicas that start on one node whose cores the load keeps busy:
    started together they share those cores, and the first serves only when all of them could. It never lowers a
    target it has set (a starting replica is not stopped), and scale-down is `cost_policy`'s."""
    wanted, state = cost_policy(ctx)
    current, running = ctx.target_num_replicas, ctx.current_num_replicas
    if wanted > current:
        wanted = max(current, min(wanted, running + 1))
    return wanted, state


__all__ = [
    "ARRIVING_COST",
    "AUTOSCALING",
    "HYSTERESIS",
    "MEAN_COST",
    "PENDING_COST",
    "PACED_POLICY_PATH",
    "POLICY_PATH",
    "TARGET_COST",
    "ArrivalMeter",
    "cost_policy",
    "desired_replicas",
    "paced_cost_policy",
    "newest",
]
