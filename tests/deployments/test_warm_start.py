"""A new Encoder replica on a node whose workers preload the Encoder's module starts on the warm spare worker the
running replica keeps there (deployments/ray_private.py): its process and imports are behind it, and it serves
within a couple of seconds of the scale-up; on a cold node it starts a process and imports. Each mode runs on a Ray
cluster of its own (the preload is the raylet's environment), in a child process: tests/deployments/warm_start.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.cluster


def _scale_up(checkpoint: Path, mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tests.deployments.warm_start", str(checkpoint), mode],
        cwd=ROOT, capture_output=True, text=True, timeout=400, check=True,
    )  # fmt: skip
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])


def test_a_new_replica_takes_the_warm_spare_and_a_cold_node_starts_one(checkpoint):
    warm, cold = _scale_up(checkpoint, "warm"), _scale_up(checkpoint, "cold")
    # the warm replica's process sat idle in the pool (seconds) after its imports; the cold one's waited for nothing
    assert max(s.get("waiting", 0.0) for s in warm["starts"]) > 3.0, warm
    assert all(s.get("waiting", 0.0) < 2.0 for s in cold["starts"]), cold
    assert warm["second_after_s"] < cold["second_after_s"], (warm, cold)
