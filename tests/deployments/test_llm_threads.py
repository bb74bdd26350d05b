"""The LLM replica's engine threads default to the CPUs Ray reserved for it (its num_cpus), never all cores."""

from __future__ import annotations

import pytest
import ray

from deployments.llm.server import reserved_cpus

pytestmark = pytest.mark.e2e


@ray.remote
class _Probe:
    def cpus(self) -> int:
        return reserved_cpus()


@pytest.mark.parametrize(("num_cpus", "threads"), [(2, 2), (1, 1), (0.4, 1)])
def test_threads_follow_the_reserved_cpus(ray_serve, num_cpus, threads):
    probe = _Probe.options(num_cpus=num_cpus).remote()
    try:
        assert ray.get(probe.cpus.remote()) == threads
    finally:
        ray.kill(probe)
