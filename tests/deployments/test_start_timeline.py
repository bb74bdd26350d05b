"""A replica's start, phase by phase (deployments/replica.py): what a scale-up waits for, as the replica measures it."""

from __future__ import annotations

import time

import pytest

from deployments.replica import START_PHASES, StartTimeline, process_started_at


def test_this_process_began_before_now_and_after_it_was_run():
    began = process_started_at()
    assert began <= time.time() and time.time() - began < 3600 * 24 * 7


def test_each_phase_is_the_time_since_the_one_before_and_a_missing_one_folds_into_the_next():
    timeline = StartTimeline(begin=101.5, imported=104.0)
    timeline.started = 100.0
    timeline.events["check"] = 104.5  # no "waiting" nor "model": they fold into "check"
    assert timeline.durations() == {"process": 1.5, "imports": 2.5, "check": 0.5}
    assert "4.50 s after its process started (process 1.50 s, imports 2.50 s, check 0.50 s)" in timeline.describe()


def test_a_phase_ends_once():
    timeline = StartTimeline(begin=time.time())
    assert timeline.mark("first_image") and not timeline.mark("first_image")
    assert set(timeline.durations()) == {"process", "first_image"}
    with pytest.raises(AssertionError):
        timeline.mark("lunch")
    assert START_PHASES == ("process", "imports", "waiting", "model", "check", "first_image")
