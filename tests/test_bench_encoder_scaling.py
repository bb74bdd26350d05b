"""`make bench-encoder-scaling`'s bookkeeping, without a cluster: what it reads from the replica counts it polled."""

from __future__ import annotations

import argparse

import pytest

from bench.encoder_scaling import Request, Round, Run, report


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


def test_the_report_ends_with_the_policies_line_without_a_baseline():
    count = _run("count", [(0.0, 1), (5.0, 3)], [(0.0, 1), (20.0, 3)], [1.0] * 99 + [10.0])
    cost = _run("cost", [(0.0, 1), (3.5, 4)], [(0.0, 1), (17.5, 4)], [1.0] * 99 + [5.0])
    args = argparse.Namespace(duration=60.0, rate=8.0, seed=0, max_replicas=4, large_s=1.0)
    text = report([Round([count, cost])], [Request(0.0, False, "")], args)
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("count ", "cost "))}
    assert rows["count"][7:9] == ["5.0", "20.0"] and rows["cost"][7:9] == ["3.5", "17.5"]  # asked at, 2nd at
    assert text.splitlines()[-1] == (
        "encoder scaling: p99 image TTFT count/cost = 2.00x, replica-seconds cost/count = "
        f"{cost.replica_seconds() / count.replica_seconds():.2f}x"
    )


def test_each_new_replica_is_timed_from_the_decision_that_asked_for_it():
    """Replicas serving 6.0 and 7.5 s after the step, asked for when the count asked first reached 2 (1.0 s) and 3
    (1.5 s): starts of 5.0 and 6.0 s, median 5.5; the replica there before the step is not a start."""
    from bench.encoder_scaling import Start

    run = _run("cost", [(0.0, 1), (1.0, 2), (1.5, 3)], [(0.0, 1), (6.0, 2), (7.5, 3)], [1.0])
    run.began = 1000.0
    run.starts = {
        "old": Start({"process": 1.0}, serving_since=900.0),
        "b": Start({"process": 1.2, "imports": 3.0}, serving_since=1007.5),
        "a": Start({"process": 1.1, "imports": 2.5}, serving_since=1006.0),
        "never": Start({}, serving_since=None),
    }
    assert [(asked, at) for asked, at, _ in run.new_starts()] == [(1.0, 6.0), (1.5, 7.5)]
    assert run.start_spans() == [5.0, 6.0]  # median 5.5


def test_the_baselines_rows_parse_and_the_report_ends_with_issue_53s_line():
    """The baseline's own bench prints the same columns; its count row is 'before', this run's cost row 'now'."""
    from bench.encoder_scaling import HEADER, Row, Start

    count = _run("count", [(0.0, 1), (5.0, 3)], [(0.0, 1), (20.0, 3)], [1.0] * 99 + [10.0])
    cost = _run("cost", [(0.0, 1), (1.0, 2)], [(0.0, 1), (6.0, 2)], [1.0] * 99 + [4.0])
    cost.began = 0.0
    cost.starts = {"a": Start({"process": 3.0, "imports": 2.0, "model": 0.5, "first_image": 0.5}, serving_since=6.0)}
    printed = Row.of(count).format()
    before = Row.parse(printed, "abc1234")
    assert before.name == "count@abc1234" and before.p99 == 10.0 and (before.asked, before.second) == (5.0, 20.0)
    assert before.target is None and Row.parse(Row.of(cost).format(), "x").target == 1.5
    args = argparse.Namespace(duration=60.0, rate=8.0, seed=0, max_replicas=4, large_s=1.0)
    text = report([Round([count, cost], ("abc1234", [before]))], [Request(0.0, False, "")], args)
    assert HEADER in text and "baseline: main at abc1234" in text
    assert (  # the process began at 0.0, before the decision at 1.0: 2 s of it count
        "  cost         #2: asked 1.0, serving 6.0: start 5.0 s (process 2.0, imports 2.0, model 0.5, first image 0.5; "
        "6.0 s from its process's start)"
    ) in text
    assert text.splitlines()[-1] == (
        f"encoder scaling: start 5.0s; p99 image TTFT before/now 2.50x; replica-seconds now/before "
        f"{cost.replica_seconds() / before.replica_s:.2f}x"
    )


def test_a_process_started_before_the_decision_counts_only_its_part_after():
    from bench.encoder_scaling import Start

    start = Start({"process": 0.5, "imports": 3.0, "waiting": 20.0, "model": 0.1, "first_image": 0.4}, 100.0)
    want = {"process": 0.0, "imports": 0.0, "waiting": 0.5, "model": 0.1, "first_image": 0.4}
    assert start.after(99.0) == pytest.approx(want)


def test_rounds_are_each_shown_and_the_last_line_pools_them():
    """Two rounds (A B, B A): every row once a round, the count/cost and before/now ratios of each, the last line
    from the rounds' mean p99s and replica-seconds and the median of every round's starts."""
    from bench.encoder_scaling import Row, Start

    def cost_run(p99: float, serving: float) -> Run:
        cost = _run("cost", [(0.0, 1), (1.0, 2)], [(0.0, 1), (serving, 2)], [1.0] * 99 + [p99])
        cost.began, cost.starts = 0.0, {"a": Start({"process": serving}, serving_since=serving)}
        return cost

    count = _run("count", [(0.0, 1), (5.0, 3)], [(0.0, 1), (20.0, 3)], [1.0] * 99 + [10.0])
    before = [Row.parse(Row.of(_run("count", [(0.0, 1)], [(0.0, 1)], [1.0] * 99 + [p])).format(), "abc1234")
              for p in (12.0, 6.0)]  # fmt: skip
    rounds = [Round([count, cost_run(4.0, 5.0)], ("abc1234", [before[0]])),
              Round([count, cost_run(2.0, 8.0)], ("abc1234", [before[1]]))]  # fmt: skip
    args = argparse.Namespace(duration=60.0, rate=8.0, seed=0, max_replicas=4, large_s=1.0)
    lines = report(rounds, [Request(0.0, False, "")], args).splitlines()
    assert [line.split()[:2] for line in lines if line.startswith(("count", "cost "))] == [
        ["count@abc1234", "#1"], ["count", "#1"], ["cost", "#1"], ["count@abc1234", "#2"], ["count", "#2"],
        ["cost", "#2"], ["count@abc1234", "mean"], ["count", "mean"], ["cost", "mean"],
    ]  # fmt: skip
    assert any(line.startswith("encoder scaling: p99 image TTFT count/cost = 3.75x (2.50x, 5.00x)") for line in lines)
    assert lines[-2] == "rounds, p99 image TTFT before/now: 3.00x (12.0 / 4.0 s), 3.00x (6.0 / 2.0 s)"
    means = {line.split()[0]: line.split()[2:] for line in lines if " mean " in line}
    assert list(means) == ["count@abc1234", "count", "cost"]  # a row per configuration, the baseline's too
    assert means["count@abc1234"][1] == "9.00" and means["cost"][1] == "3.00"  # p99: (12 + 6) / 2, (4 + 2) / 2
    assert means["cost"][6:8] == ["1.0", "6.5"]  # asked at, 2nd at: (5 + 8) / 2
    assert means["count@abc1234"][6:8] == ["-", "-"]  # never asked in any round
    assert lines[-1].startswith("encoder scaling: start 5.5s; p99 image TTFT before/now 3.00x; ")
