"""What each of our Serve replicas knows of itself: its id, how its start went, and how often it looks whether its
requests have ended when it stops."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ray import serve

# How often a stopping replica of ours looks whether its requests have ended (Serve's default, 2 s): each deleted app,
# redeploy and scale-down waits at least one look, and a replica that had work two.
DRAIN_POLL_S = 0.5


def this_replica() -> str | None:
    """This Serve replica's unique id; None outside a replica (tests that build a deployment's class directly)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return None


def process_started_at() -> float:
    """When this process began, in epoch seconds (to 10 ms, from /proc: its start in clock ticks after boot, and the
    uptime now); now where /proc is absent."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


# The phases of a replica's start, each named by the event that ends it: `process` (from its process's start to its
# deployment's module beginning to import: Ray's worker and Serve's replica set-up), `imports` (the module's imports),
# `waiting` (imported, to the replica's constructor: the rest of Serve's set-up), `model` (the tower built and its
# weights read), `check` (the start-up check, or reusing its result), `first_image` (ready, to the first image it
# served: the routers learning of it, and the first call). A replica started in a warm process (encoder.warm_workers)
# counts that process's idle wait in `process`; its start is the part after the decision.
START_PHASES = ("process", "imports", "waiting", "model", "check", "first_image")


class StartTimeline:
    """When each phase of this replica's start ended (epoch seconds), from its process's start: what a scale-up waits
    for, measured where it happens. `begin` and `imported`: when the deployment's module began and ended importing
    (None: not timed, the phase folds into the next)."""

    def __init__(self, begin: float | None = None, imported: float | None = None):
        self.started = process_started_at()
        self.events = {phase: t for phase, t in (("process", begin), ("imports", imported)) if t is not None}

    def mark(self, phase: str) -> bool:
        """`phase` ends now; False (and nothing recorded) when it already had."""
        assert phase in START_PHASES, phase
        if phase in self.events:
            return False
        self.events[phase] = time.time()
        return True

    def durations(self) -> dict[str, float]:
        """Seconds each recorded phase took (a phase not recorded folds into the next recorded one)."""
        out, last = {}, self.started
        for phase in START_PHASES:
            if phase in self.events:
                out[phase], last = max(0.0, self.events[phase] - last), max(last, self.events[phase])
        return out

    def describe(self) -> str:
        d = self.durations()
        parts = ", ".join(f"{phase.replace('_', ' ')} {seconds:.2f} s" for phase, seconds in d.items())
        return f"{sum(d.values()):.2f} s after its process started ({parts})"


__all__ = ["DRAIN_POLL_S", "START_PHASES", "StartTimeline", "process_started_at", "this_replica"]
