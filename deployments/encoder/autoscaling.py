"""The Encoder deployment's autoscaling policy: as many replicas as the encoder work pending and arriving needs.

Each Encoder replica reports, through Serve's custom autoscaling metrics (`record_autoscaling_stats`), the cost of
the images it has queued and running (encoders/cost.py, GFLOP), the cost that arrived at it over the last window
scaled to one target queueing delay and over `encoder.target_utilization` (the leading signal: it rises with the
arrival rate, before a queue builds; work arriving at that share of a replica's rate is one replica's worth), the
mean cost of an image it took, and the cost one replica should hold (`encoder.target_cost_per_replica`, by default
its measured GFLOP/s times `encoder.target_queue_delay_s`). Images the ingress could not place yet (every replica
at `max_ongoing_requests`) are Serve's own handle metric, `total_queued_requests`; they count at the mean cost.
Serve averages each metric over `look_back_period_s`, which follows a load step seconds late; the policy also reads
each replica's newest report (`raw_metrics`) and takes the larger of the two decisions: scale-up follows the newest
report, scale-down waits until the window's mean has come down too (and then Serve's `downscale_delay_s`). Both
decisions hold a band of `HYSTERESIS` of a replica's target around the count they have: up once the work exceeds the
replicas there are by that much, down once one replica fewer would still have that much to spare, so a steady load
near a boundary does not make the count flap with each report's noise.
`CostPolicy` paces what `cost_policy` decides: at most one replica starting per node of the cluster at a time (a
replica started beside busy ones, or beside another starting one, shares their cores: three started together on one
2-core host took 7-10 s each, one alone 3 s; BENCHMARKS.md). Serve's controller makes one per deployment (it pickles
this module by value: keep it free of the project's imports), with `policy_kwargs`, then applies min/max_replicas and
upscale/downscale_delay_s as for its own policy. AUTOSCALING names it; without `policy:` the Encoder scales on
requests in flight, Serve's default."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

PENDING_COST = "pending_cost"  # GFLOP of encoder work queued and running on a replica
ARRIVING_COST = "arriving_cost"  # GFLOP arriving at a replica per target delay, over the target utilization
MEAN_COST = "mean_cost"  # GFLOP of an image (or video chunk) a replica took, on average over the window
TARGET_COST = "target_cost"  # GFLOP of pending work one replica should hold
POLICY_PATH = "deployments.encoder.autoscaling:CostPolicy"
# The Encoder deployment's autoscaling options (its decorator's; the KubeRay manifest raises max_replicas), tuned for
# reaction time rather than Ray's defaults (upscale 30 s, downscale 600 s, metrics every 10 s over 30 s): replicas
# report four times a second and a replica is asked for once the reports are over target for 0.25 s (a load step is
# seen 3-4 s after it on the bench's load: its second large photo comes 1.8 s in; a replica's start, 1-2 s in a warm
# process and 3-5 s in a new one, is the rest of the wait), and one goes 30 s after the load is gone.
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "policy": {"policy_function": POLICY_PATH},
    "upscale_delay_s": 0.25,
    "downscale_delay_s": 30,
    "metrics_interval_s": 0.25,
    "look_back_period_s": 5,
}
NODES_EVERY_S = 10.0  # how often CostPolicy counts the cluster's nodes
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


def paced(wanted: int, target: int, running: int, max_starting: int) -> int:
    """`wanted`, with at most `max_starting` replicas starting (the target above the replicas running): more only as
    starting ones come up. It never lowers a target for that (a starting replica is not stopped); down is as wanted."""
    if wanted <= target:
        return wanted
    return max(target, min(wanted, running + max_starting))


def cluster_nodes() -> int:
    """The cluster's live nodes with CPUs: where Serve places replicas, spread over them by default."""
    import ray  # NOTE: here, not at the top: the tests and the bench import this module without a cluster

    return max(1, sum(1 for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0))


class CostPolicy:
    """Serve's `autoscaling_config.policy` (`policy_function` this class's path; `policy_kwargs` its arguments): the
    replicas `cost_policy` decides, at most `max_starting` of them starting at a time. By default one per node of
    the cluster (counted every NODES_EVERY_S): on one host, a new replica starts alone on cores the load keeps busy
    instead of sharing them with two more; on several, Serve spreads the new ones a node each and they start
    together. Set it where one node has the cores for several starts at once (a node of eight GPUs: 8)."""

    def __init__(
        self,
        max_starting: int | None = None,
        count_nodes: Callable[[], int] = cluster_nodes,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_starting is not None and max_starting < 1:
            raise ValueError(f"max_starting must be at least 1 (or None: one per node), got {max_starting}")
        self.max_starting, self.count_nodes, self.clock = max_starting, count_nodes, clock
        self._nodes, self._counted_at = 1, -math.inf

    def starts(self) -> int:
        """How many replicas may be starting at once now."""
        if self.max_starting is not None:
            return self.max_starting
        if self.clock() - self._counted_at >= NODES_EVERY_S:
            self._counted_at = self.clock()
            try:
                self._nodes = self.count_nodes()
            except Exception:  # the GCS busy or restarting: keep the last count, try again next time
                pass
        return self._nodes

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        wanted, state = cost_policy(ctx)
        return paced(wanted, ctx.target_num_replicas, ctx.current_num_replicas, self.starts()), state


__all__ = [
    "ARRIVING_COST",
    "AUTOSCALING",
    "HYSTERESIS",
    "MEAN_COST",
    "NODES_EVERY_S",
    "PENDING_COST",
    "POLICY_PATH",
    "TARGET_COST",
    "ArrivalMeter",
    "CostPolicy",
    "cost_policy",
    "desired_replicas",
    "newest",
    "paced",
]
