"""The Encoder's cost policy: its decisions on synthetic metrics, and the parts of Serve's alpha autoscaling API it
relies on (a policy named by import path, run with each replica's custom metrics, its upscale and downscale delays
applied by Serve's own wrapper)."""

from __future__ import annotations

import pytest
from ray.serve import autoscaling_policy as serve_policy
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.encoder.autoscaling import (
    ARRIVING_COST,
    MEAN_COST,
    NODES_EVERY_S,
    PENDING_COST,
    POLICY_PATH,
    TARGET_COST,
    ArrivalMeter,
    CostPolicy,
    cost_policy,
    desired_replicas,
)
from deployments.encoder.server import DEFAULT_TARGET_COST, Encoder
from schemas import EncoderArgs

ENCODER = DeploymentID(name="Encoder", app_name="vlm")
REPLICAS = [ReplicaID(f"r{i}", ENCODER) for i in range(3)]


def test_replicas_are_the_pending_cost_over_the_target():
    targets = {r: 10.0 for r in REPLICAS[:2]}
    assert desired_replicas({REPLICAS[0]: 25.0, REPLICAS[1]: 10.0}, targets, current=2) == 4  # ceil(35 / 10)
    assert desired_replicas({REPLICAS[0]: 7.0, REPLICAS[1]: 0.0}, targets, current=2) == 1
    assert desired_replicas({REPLICAS[0]: 0.0, REPLICAS[1]: 0.0}, targets, current=2) == 0  # Serve then keeps min
    assert desired_replicas({}, {}, current=2) == 2  # no replica reported yet: stay


def test_a_few_large_images_scale_where_counting_requests_would_not():
    """Three 8-GFLOP images in flight on one replica: 3 requests, under Serve's `target_ongoing_requests: 4`, but
    24 GFLOP against a 10 GFLOP target: three replicas. Fifty thumbnails of 0.01: one."""
    target = {REPLICAS[0]: 10.0}
    assert desired_replicas({REPLICAS[0]: 3 * 8.0}, target, current=1) == 3
    assert desired_replicas({REPLICAS[0]: 50 * 0.01}, target, current=1) == 1


def _context(
    pending: dict,
    current: int,
    target: int,
    state: dict,
    config: AutoscalingConfig,
    queued: float = 0.0,
    raw: dict | None = None,
    **metrics,
) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=ENCODER,
        deployment_name="Encoder",
        app_name="vlm",
        current_num_replicas=current,
        target_num_replicas=target,
        running_replicas=REPLICAS[:current],
        total_num_requests=float(len(pending)),
        total_queued_requests=queued,
        aggregated_metrics={PENDING_COST: pending, TARGET_COST: {r: 10.0 for r in pending}, **metrics},
        raw_metrics=raw or {},
        capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=state,
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=config,
    )


def test_serve_resolves_the_policy_by_path_and_applies_its_delays(monkeypatch):
    config = AutoscalingConfig(
        min_replicas=1, max_replicas=4, upscale_delay_s=2, downscale_delay_s=5, policy={"policy_function": POLICY_PATH}
    )
    # By value, unpickled; a class is made once with `policy_kwargs`, then called on each tick (Ray 2.60's controller)
    made = config.policy.get_policy()(**config.policy.policy_kwargs, count_nodes=lambda: 4)
    assert made(_context({REPLICAS[0]: 35.0}, 1, 1, {}, config))[0] == 4
    policy = serve_policy._apply_autoscaling_config(made)  # what Serve's controller runs
    now = [1000.0]
    monkeypatch.setattr(serve_policy.time, "time", lambda: now[0])

    def decide(pending: dict, current: int, state: dict) -> tuple[int, dict]:
        return policy(_context(pending, current, current, state, config))

    busy = {REPLICAS[0]: 35.0}
    replicas, state = decide(busy, 1, {})
    assert replicas == 1  # over target, but not yet for upscale_delay_s
    now[0] += 2.5
    replicas, state = decide(busy, 1, state)
    assert replicas == 4
    idle = {r: 0.0 for r in REPLICAS[:3]}
    replicas, state = decide(idle, 3, state)
    assert replicas == 3  # idle, but not yet for downscale_delay_s
    now[0] += 5.5
    assert decide(idle, 3, state)[0] == 1  # not 0: Serve's wrapper scales to zero only from one replica


@pytest.mark.parametrize("policy", [{"policy_function": POLICY_PATH}, None])
def test_the_count_policy_stays_selectable(policy):
    """Without `policy`, Serve's default (requests in flight against target_ongoing_requests)."""
    extra = {"policy": policy} if policy else {}
    config = AutoscalingConfig(min_replicas=1, max_replicas=2, target_ongoing_requests=4, **extra)
    assert config.policy.is_default_policy_function() is (policy is None)


def test_cost_arriving_faster_than_the_replicas_drain_it_scales_before_a_queue_builds():
    """The leading signal: 25 GFLOP arrived per target delay while 1 is pending (the replica keeps up so far, its
    queue is short): 3 replicas. Pending work is not counted twice: what just arrived is also pending."""
    target = {REPLICAS[0]: 10.0}
    assert desired_replicas({REPLICAS[0]: 1.0}, target, 1, arriving={REPLICAS[0]: 25.0}) == 3
    assert desired_replicas({REPLICAS[0]: 1.0}, target, 1) == 1  # the lagging signal alone: not yet
    assert desired_replicas({REPLICAS[0]: 25.0}, target, 1, arriving={REPLICAS[0]: 25.0}) == 3  # max, not sum


def test_images_queued_at_the_ingress_count_at_the_mean_cost():
    """Every replica at max_ongoing_requests: Serve counts the calls waiting in the ingress's handle
    (total_queued_requests); the policy prices them at the replicas' mean image cost."""
    config = AutoscalingConfig(min_replicas=1, max_replicas=8, policy={"policy_function": POLICY_PATH})
    pending = {REPLICAS[0]: 5.0}
    ctx = _context(pending, 1, 1, {}, config, queued=20.0, **{MEAN_COST: {REPLICAS[0]: 1.0}})
    assert cost_policy(ctx)[0] == 3  # ceil((5 + 20 x 1) / 10)
    assert cost_policy(_context(pending, 1, 1, {}, config, queued=20.0))[0] == 1  # no mean reported: priced at 0
    ctx = _context(pending, 1, 1, {}, config, **{ARRIVING_COST: {REPLICAS[0]: 41.0}})
    assert cost_policy(ctx)[0] == 5


def test_the_arrival_meter_is_the_cost_over_its_window():
    """Over the whole window, however young the meter: a replica that has just started reports its share, not the
    load its peers' windows still hold."""
    now = [0.0]
    meter = ArrivalMeter(window_s=5.0, clock=lambda: now[0])
    assert meter.rate() == meter.mean() == 0.0
    for cost in (2.0, 4.0, 6.0):
        meter.add(cost)
        now[0] += 1.0
    assert meter.rate() == 12.0 / 5 and meter.mean() == 4.0
    now[0] = 6.5  # the first arrival (t=0) and the second (t=1) are out of the window
    assert meter.rate() == 6.0 / 5 and meter.mean() == 6.0
    now[0] = 100.0
    assert meter.rate() == meter.mean() == 0.0


@pytest.mark.parametrize(
    ("set_to", "gflops", "expected"), [(7.0, 40.0, 7.0), (None, 40.0, 20.0), (None, None, DEFAULT_TARGET_COST)]
)
def test_the_target_is_as_set_else_the_measured_rate_times_the_delay(set_to, gflops, expected):
    opts = EncoderArgs(target_cost_per_replica=set_to, target_queue_delay_s=0.5)
    assert Encoder.func_or_class._target_cost(opts, gflops) == expected


def test_a_steady_load_near_a_boundary_holds_its_count():
    """Reports that wander around a boundary (1.9 to 2.1 replicas' worth) move neither 2 replicas up nor 3 down; a
    clear change does (2.3 up to 3; 1.7 down to 2, from 3; 0.7 down to 1)."""
    target = {REPLICAS[0]: 10.0}
    for need in (19.0, 20.0, 21.0):
        assert desired_replicas({REPLICAS[0]: need}, target, current=2) == 2
        assert desired_replicas({REPLICAS[0]: need}, target, current=3) == 3
    assert desired_replicas({REPLICAS[0]: 23.0}, target, current=2) == 3
    assert desired_replicas({REPLICAS[0]: 17.0}, target, current=3) == 2
    assert desired_replicas({REPLICAS[0]: 7.0}, target, current=2) == 1


def test_a_step_scales_on_the_newest_report_and_down_only_once_the_window_has_come_down():
    """Serve's window mean follows a step seconds late: 35 GFLOP pending in the newest report, the five-second
    mean still 7 (one replica's worth): four replicas now. Back to idle in the newest report while the mean still
    holds 35: the mean keeps four (scale-down also waits for it)."""
    config = AutoscalingConfig(min_replicas=1, max_replicas=8, policy={"policy_function": POLICY_PATH})

    def series(*values: float) -> list[TimeStampedValue]:  # oldest first, as Serve keeps them; newest last
        return [TimeStampedValue(100.0 + i, v) for i, v in enumerate(values)]

    def raw(*values: float) -> dict:
        return {PENDING_COST: {REPLICAS[0]: series(*values)}, TARGET_COST: {REPLICAS[0]: series(10.0)}}

    step = _context({REPLICAS[0]: 7.0}, 1, 1, {}, config, raw=raw(0, 0, 0, 0, 35))
    assert cost_policy(step)[0] == 4
    assert cost_policy(_context({REPLICAS[0]: 7.0}, 1, 1, {}, config))[0] == 1  # the mean alone: not yet
    calm = _context({REPLICAS[0]: 35.0}, 4, 4, {}, config, raw=raw(35, 35, 35, 35, 0))
    assert cost_policy(calm)[0] == 4
    assert cost_policy(_context({REPLICAS[0]: 0.0}, 4, 4, {}, config, raw=raw(35, 0)))[0] == 0  # both low


def test_the_policy_starts_one_replica_at_a_time_on_one_node():
    """35 GFLOP pending for a 10 GFLOP target: `cost_policy` asks for 4 at once; on one node the shipped policy asks
    for 2 while one runs, no more while that one is starting (target 2, running 1), 3 once it runs; it never takes
    back a target (3 asked, 1 running: 3 stays) and scales down as `cost_policy` does."""
    config = AutoscalingConfig(min_replicas=1, max_replicas=8, policy={"policy_function": POLICY_PATH})
    pending = {REPLICAS[0]: 35.0}
    policy = CostPolicy(count_nodes=lambda: 1)
    assert cost_policy(_context(pending, 1, 1, {}, config))[0] == 4
    assert policy(_context(pending, 1, 1, {}, config))[0] == 2
    assert policy(_context(pending, 1, 2, {}, config))[0] == 2
    assert policy(_context(pending, 2, 2, {}, config))[0] == 3
    assert policy(_context(pending, 1, 3, {}, config))[0] == 3
    assert policy(_context({REPLICAS[0]: 0.0}, 3, 3, {}, config))[0] == 0


def test_the_policy_starts_one_replica_per_node_at_a_time_or_as_many_as_set():
    """Three nodes: three start together (1 running, 4 asked); `max_starting: 2` set: two, on any number of nodes."""
    config = AutoscalingConfig(min_replicas=1, max_replicas=8, policy={"policy_function": POLICY_PATH})
    pending = {REPLICAS[0]: 55.0}  # 6 replicas' worth
    assert CostPolicy(count_nodes=lambda: 3)(_context(pending, 1, 1, {}, config))[0] == 4
    assert CostPolicy(count_nodes=lambda: 3)(_context(pending, 3, 4, {}, config))[0] == 6
    assert CostPolicy(max_starting=2, count_nodes=lambda: 9)(_context(pending, 1, 1, {}, config))[0] == 3
    with pytest.raises(ValueError, match="max_starting"):
        CostPolicy(max_starting=0)


def test_the_policy_counts_the_nodes_every_few_seconds_and_keeps_the_last_count_when_it_cannot():
    now, counts = [0.0], iter([1, 2, RuntimeError("the GCS is restarting"), 3])

    def count() -> int:
        got = next(counts)
        if isinstance(got, Exception):
            raise got
        return got

    policy = CostPolicy(count_nodes=count, clock=lambda: now[0])
    assert policy.starts() == 1
    now[0] += NODES_EVERY_S / 2
    assert policy.starts() == 1  # not counted again yet
    now[0] += NODES_EVERY_S
    assert policy.starts() == 2  # a node joined
    now[0] += NODES_EVERY_S
    assert policy.starts() == 2  # the count failed: the last one
    now[0] += NODES_EVERY_S
    assert policy.starts() == 3
