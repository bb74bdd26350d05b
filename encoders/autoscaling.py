"""The Encoder deployment's autoscaling policy: as many replicas as the encoder work pending needs, by cost.

Each Encoder replica reports, through Serve's custom autoscaling metrics (`record_autoscaling_stats`), the cost of
the images it has queued and running (encoders/cost.py, GFLOP) and the cost one replica should hold
(`encoder.target_cost_per_replica`). Serve's controller runs `cost_policy` (it pickles this module by value: keep
it free of the project's imports), then applies min/max_replicas and upscale/downscale_delay_s as for its own
policy. serve_config.yaml names it; without `policy:` the Encoder scales on requests in flight, Serve's default."""

from __future__ import annotations

import math
from typing import Any

PENDING_COST = "pending_cost"  # GFLOP of encoder work queued and running on a replica
TARGET_COST = "target_cost"  # GFLOP of pending work one replica should hold
POLICY_PATH = "encoders.autoscaling:cost_policy"


def desired_replicas(pending: dict[Any, float], targets: dict[Any, float], current: int) -> int:
    """ceil(total pending cost / target cost per replica); `current` while no replica has reported a target."""
    target = max(targets.values(), default=0.0)
    if target <= 0:
        return current
    return math.ceil(sum(pending.values()) / target)


def cost_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Serve's `autoscaling_config.policy.policy_function` (an AutoscalingContext in; replicas and policy state
    out). The metrics are each replica's values averaged over `look_back_period_s` (Serve's aggregation)."""
    metrics = ctx.aggregated_metrics or {}
    return desired_replicas(metrics.get(PENDING_COST, {}), metrics.get(TARGET_COST, {}), ctx.target_num_replicas), {}


__all__ = ["PENDING_COST", "POLICY_PATH", "TARGET_COST", "cost_policy", "desired_replicas"]
