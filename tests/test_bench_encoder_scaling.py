"""`make bench-encoder-scaling`'s bookkeeping, without a cluster: what it reads from the replica counts it polled."""

from __future__ import annotations

import argparse

from bench.encoder_scaling import Request, Run, report


def _run(name: str, asked: list[tuple[float, int]], live: list[tuple[float, int]], latencies: list[float]) -> Run:
    run = Run(name, latencies=[(False, s, 200) for s in latencies], replicas=live, asked=asked, end=40.0)
    run.target_cost = None if name == "count" else 1.5
    return run


def test_the_policy_delay_and_the_replica_start_are_told_apart():
    """Asked for at 3.5 s (a replica STARTING), serving at 17.5 s: the report shows both; replica-seconds integrate
    the RUNNING count over the run."""
    run = _run("cost", [(0.0, 1), (3.5, 4)], [(0.0, 1), (17.5, 4)], [1.0] * 99 + [9.0])
    assert run.scale_up_asked_at() == 3.5
    assert run.second_replica_at() == 17.5
    assert run.replica_seconds() == 17.5 * 1 + (40.0 - 17.5) * 4
    assert run.pct(0.99) == 9.0
    never = _run("count", [(0.0, 1)], [(0.0, 1)], [1.0])
    assert never.scale_up_asked_at() is None and never.second_replica_at() is None


def test_the_report_ends_with_issue_22s_line():
    count = _run("count", [(0.0, 1), (5.0, 3)], [(0.0, 1), (20.0, 3)], [1.0] * 99 + [10.0])
    cost = _run("cost", [(0.0, 1), (3.5, 4)], [(0.0, 1), (17.5, 4)], [1.0] * 99 + [5.0])
    args = argparse.Namespace(duration=60.0, rate=8.0, seed=0, max_replicas=4, large_s=1.0)
    text = report([count, cost], [Request(0.0, False, "")], args)
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("count ", "cost "))}
    assert rows["count"][7:9] == ["5.0", "20.0"] and rows["cost"][7:9] == ["3.5", "17.5"]  # asked at, 2nd at
    assert text.splitlines()[-1] == (
        "encoder scaling: p99 image TTFT count/cost = 2.00x, replica-seconds cost/count = "
        f"{cost.replica_seconds() / count.replica_seconds():.2f}x"
    )
