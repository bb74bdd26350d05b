"""The Encoder deployment scales on cost in the running app: a few large images in flight (fewer than Serve's
request-count policy scales on) bring a second replica, exactly as many as their cost asks for, and it goes once
they are done."""

from __future__ import annotations

import asyncio
import functools
import time

import httpx
import pytest
from ray import serve

from deployments.encoder.autoscaling import POLICY_PATH
from deployments.encoder.server import Encoder
from deployments.ingress import Ingress
from deployments.llm.server import LLM
from encoders import ModelSpec
from tests.deployments.instruments import SlowEncoder
from tests.helpers import data_url, make_image

pytestmark = pytest.mark.e2e
SMALL = {"num_cpus": 0.1}  # these apps share the session's logical CPUs with the others
BIG = (448, 448)  # over the test checkpoint's max_pixels: its most patches
IN_FLIGHT = 3  # large images in flight at a time: under `target_ongoing_requests: 4`, Serve's policy stays at 1


@pytest.fixture(scope="module")
def scaling(ray_serve, app_args, checkpoint, tmp_path_factory):
    spec = ModelSpec.load(checkpoint, device="cpu")
    big = spec.image_cost.gflop(spec.processing.grid_thw(*BIG))
    # Two large images' worth per replica: three in flight ask for ceil(3 / 2) = 2 replicas, one for 1.
    encoder_args = {"cache_gib": 0, "startup_check": False, "target_cost_per_replica": 2 * big}
    args = {**app_args, "encoder": encoder_args}
    autoscaling = {
        "min_replicas": 1,
        "max_replicas": 3,  # above what the cost asks for: the policy's number shows, not the bound
        "policy": {"policy_function": POLICY_PATH},
        "upscale_delay_s": 1,
        "downscale_delay_s": 4,
        "metrics_interval_s": 0.5,
        "look_back_period_s": 2,
    }
    slow = functools.partial(SlowEncoder, delay_s=1.0, record_dir=str(tmp_path_factory.mktemp("forwards")))
    encoder = Encoder.options(ray_actor_options=SMALL, autoscaling_config=autoscaling).bind(args, model_factory=slow)
    llm = LLM.options(ray_actor_options=SMALL).bind(args)
    app = Ingress.options(ray_actor_options=SMALL).bind(encoder, llm, args)
    serve.run(app, name="costscaling", route_prefix="/costscaling")
    yield f"{ray_serve}/costscaling"
    serve.delete("costscaling")


def _states() -> dict[str, int]:
    return serve.status().applications["costscaling"].deployments["Encoder"].replica_states


def test_a_few_large_images_scale_the_encoders_up_and_back_down(scaling):
    assert _states() == {"RUNNING": 1}
    peak, stop_at = 0, time.monotonic() + 90  # a cap: the load goes on until two replicas run, however slow

    async def client_loop(client: httpx.AsyncClient, worker: int) -> list[int]:
        statuses = []
        while time.monotonic() < stop_at:
            image = make_image(*BIG, seed=1000 * worker + len(statuses))
            parts = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "?"}]
            body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 1}
            statuses.append((await client.post("/v1/chat/completions", json=body)).status_code)
        return statuses

    async def load() -> list[int]:
        nonlocal peak, stop_at
        async with httpx.AsyncClient(base_url=scaling, timeout=90) as client:
            tasks = [asyncio.create_task(client_loop(client, w)) for w in range(IN_FLIGHT)]
            while not all(t.done() for t in tasks):
                running = _states().get("RUNNING", 0)
                if running >= 2 and peak < 2:
                    stop_at = min(stop_at, time.monotonic() + 4)  # a while at two: would it ask for a third?
                peak = max(peak, running)
                await asyncio.sleep(0.25)
            return [s for t in tasks for s in t.result()]

    statuses = asyncio.run(load())
    assert statuses and set(statuses) == {200}, statuses
    assert peak == 2, f"peak {peak} replicas for {IN_FLIGHT} large images in flight"
    deadline = time.monotonic() + 60
    while _states() != {"RUNNING": 1}:
        assert time.monotonic() < deadline, f"did not scale back down: {_states()}"
        time.sleep(0.5)
