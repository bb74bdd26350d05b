"""The LLM deployment autoscales on its own load, like the encoders: text-only streams (no image reaches the encoder
tier) bring up a second LLM replica, which then serves its share; when they stop, it goes."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from ray import serve

from deployments.encoder.server import Encoder
from deployments.ingress import Ingress
from deployments.llm.server import LLM
from tests.deployments.instruments import per_replica

pytestmark = pytest.mark.e2e
APP = "llmscale"
SMALL = {"num_cpus": 0.1}


def _llm_states() -> dict[str, int]:
    return serve.status().applications[APP].deployments["LLM"].replica_states


@pytest.fixture(scope="module")
def scaling(ray_serve, app_args):
    args = {**app_args, "encoder": {"startup_check": False}}
    # serve_config.yaml's policy, with short delays so that the test is quick
    autoscaling = {
        "min_replicas": 1,
        "max_replicas": 2,
        "target_ongoing_requests": 2,
        "upscale_delay_s": 1,
        "downscale_delay_s": 4,
        "metrics_interval_s": 0.5,
        "look_back_period_s": 2,
    }
    llm = LLM.options(autoscaling_config=autoscaling, ray_actor_options={"num_cpus": 0.5}).bind(args)
    encoder = Encoder.options(ray_actor_options=SMALL, num_replicas=1, autoscaling_config=None).bind(args)
    serve.run(Ingress.options(ray_actor_options=SMALL).bind(encoder, llm, args), name=APP, route_prefix=f"/{APP}")
    yield f"{ray_serve}/{APP}"
    serve.delete(APP)


def test_text_load_scales_the_llm_up_and_down(scaling, metrics_port):
    assert _llm_states().get("RUNNING", 0) == 1
    stop_at, peak = time.monotonic() + 150, 0  # a cap: the load goes on until a second replica has served

    def both_served() -> bool:
        served = per_replica(metrics_port, APP, "ray_vlm_inter_token_latency_seconds_count")
        return sum(v > 0 for v in served.values()) >= 2

    async def worker(client: httpx.AsyncClient, w: int) -> list[int]:
        statuses = []
        while time.monotonic() < stop_at:
            body = {
                "messages": [{"role": "user", "content": f"Stream {w}, request {len(statuses)}: tell a story."}],
                "max_tokens": 48,
                "temperature": 0,
                "ignore_eos": True,
            }
            statuses.append((await client.post("/v1/chat/completions", json=body)).status_code)
        return statuses

    async def load() -> list[int]:
        nonlocal stop_at, peak
        async with httpx.AsyncClient(base_url=scaling, timeout=90) as client:
            tasks = [asyncio.create_task(worker(client, w)) for w in range(8)]
            while not all(t.done() for t in tasks):
                peak = max(peak, _llm_states().get("RUNNING", 0))
                if peak >= 2 and stop_at > time.monotonic() + 2 and both_served():
                    stop_at = time.monotonic() + 2
                await asyncio.sleep(0.5)
            return [s for t in tasks for s in t.result()]

    statuses = asyncio.run(load())
    assert statuses and set(statuses) == {200}, statuses
    assert peak == 2 and both_served(), f"peak {peak} LLM replicas"
    deadline = time.monotonic() + 90
    while _llm_states().get("RUNNING", 0) != 1 or sum(_llm_states().values()) != 1:
        assert time.monotonic() < deadline, f"did not scale down: {_llm_states()}"
        time.sleep(0.5)
