"""The Encoder deployment scales on cost in the running app: a few large images in flight (fewer than Serve's request-
count policy scales on) bring a second replica, exactly as many as their cost asks for, started in a process the
first left warm, and it goes once they are done; a steady load right at a boundary between two counts, with the
shipped delays, settles on one count and keeps it (issue 53: no flapping)."""

from __future__ import annotations

import asyncio
import functools
import random
import time

import httpx
import pytest
from ray import serve

from demo.inputs import data_url, image_bytes, make_image
from deployments.encoder.autoscaling import AUTOSCALING, POLICY_PATH
from deployments.encoder.server import Encoder
from deployments.ingress import Ingress
from deployments.llm.server import LLM
from deployments.ray_private import idle_workers
from encoders import ModelSpec
from schemas import EncoderArgs
from tests.deployments.instruments import SlowEncoder, forwards

pytestmark = pytest.mark.e2e
SMALL = {"num_cpus": 0.1}  # these apps share the session's logical CPUs with the others
BIG = (448, 448)  # over the test checkpoint's max_pixels: its most patches
IN_FLIGHT = 3  # large images in flight at a time: under `target_ongoing_requests: 4`, Serve's policy stays at 1


@pytest.fixture(scope="module")
def scaling(ray_serve, app_args, checkpoint, tmp_path_factory):
    spec = ModelSpec.load(checkpoint, device="cpu")
    big = spec.image_cost.gflop(spec.processing.grid_thw(*BIG))
    # Two large images' worth per replica: three in flight ask for ceil(3 / 2) = 2 replicas, one for 1. The clients
    # loop, so the rate their images arrive at is the rate they are served at (a batched forward serves several at
    # once): the arriving signal (that rate over target_queue_delay_s, over target_utilization) is kept under one
    # replica's target at any rate they reach (3 a second: 3 x 0.25 / 0.7 = 1.1 large images), so that what the
    # test sees is the cost in flight's count (a CI run at 2 s saw the loop's rate ask for a third replica).
    encoder_args = {"cache_gib": 0, "startup_check": False, "target_cost_per_replica": 2 * big}
    encoder_args["target_queue_delay_s"] = 0.25
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
    record_dir = str(tmp_path_factory.mktemp("forwards"))
    slow = functools.partial(SlowEncoder, delay_s=1.0, record_dir=record_dir)
    encoder = Encoder.options(ray_actor_options=SMALL, autoscaling_config=autoscaling).bind(args, model_factory=slow)
    llm = LLM.options(ray_actor_options=SMALL).bind(args)
    app = Ingress.options(ray_actor_options=SMALL).bind(encoder, llm, args)
    serve.run(app, name="costscaling", route_prefix="/costscaling")
    yield f"{ray_serve}/costscaling", record_dir
    serve.delete("costscaling")


def _states() -> dict[str, int]:
    return serve.status().applications["costscaling"].deployments["Encoder"].replica_states


def test_a_few_large_images_scale_the_encoders_up_and_back_down(scaling):
    url, record_dir = scaling
    assert _states() == {"RUNNING": 1}
    deadline = time.monotonic() + 60  # the replica leaves warm processes once ready (encoder.warm_workers)
    while not (warm := idle_workers()) and time.monotonic() < deadline:
        time.sleep(0.2)
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
        async with httpx.AsyncClient(base_url=url, timeout=90) as client:
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
    served_by = {pid for pid, _, _ in forwards(record_dir)}
    assert len(served_by) == 2 and len(served_by & warm) == 1, f"replicas {served_by}, warm before {warm}"
    deadline = time.monotonic() + 60
    while _states() != {"RUNNING": 1}:
        assert time.monotonic() < deadline, f"did not scale back down: {_states()}"
        time.sleep(0.5)


STEADY_RATE, STEADY_S, SETTLE_S = 20.0, 120.0, 30.0  # images a second, for two minutes; settled after 30 s


def test_a_steady_load_at_a_boundary_does_not_flap(ray_serve, app_args, checkpoint, tmp_path_factory):
    """Two minutes of Poisson arrivals whose cost is 1.6 replicas' targets, with the shipped policy and delays: the
    count may move in the first 30 s (to 2), never after. (Each report's need wanders by about a tenth: 20 images a
    second over the 5 s the arrival meter sees; the policy's band holds the count, where ceil() alone would follow
    the noise across a boundary: tests/deployments/encoder/test_autoscaling.py.)"""
    spec = ModelSpec.load(checkpoint, device="cpu")
    image = image_bytes(make_image(64, 64, seed=7))
    cost = spec.image_cost.gflop(spec.processing.grid_thw(64, 64))
    opts = EncoderArgs()  # the arriving cost is its rate times target_queue_delay_s over target_utilization
    target = STEADY_RATE * cost * opts.target_queue_delay_s / opts.target_utilization / 1.6  # 1.6 replicas' worth
    args = {**app_args, "encoder": {"cache_gib": 0, "startup_check": False, "target_cost_per_replica": target}}
    slow = functools.partial(SlowEncoder, delay_s=0.02, record_dir=str(tmp_path_factory.mktemp("steady")))
    options = {"ray_actor_options": SMALL, "autoscaling_config": {**AUTOSCALING, "max_replicas": 4}}
    handle = serve.run(Encoder.options(**options).bind(args, model_factory=slow), name="steady", route_prefix=None)
    counts: list[tuple[float, int]] = []  # (seconds into the load, replicas RUNNING or on their way)

    async def load() -> list[bool]:
        rng, start, calls = random.Random(0), time.monotonic(), []
        at = 0.0
        while (at := at + rng.expovariate(STEADY_RATE)) < STEADY_S:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            calls.append(asyncio.ensure_future(handle.encode.remote([image], cost=cost)))
            if not counts or time.monotonic() - start - counts[-1][0] >= 1.0:
                states = serve.status().applications["steady"].deployments["Encoder"].replica_states
                counts.append((time.monotonic() - start, sum(states.get(s, 0) for s in ("RUNNING", "STARTING"))))
        return [not isinstance(out[0], Exception) for out in await asyncio.gather(*calls)]

    try:
        assert all(asyncio.run(load()))
    finally:
        serve.delete("steady")
    changes = [(round(t, 1), n) for (t, n), (_, m) in zip(counts, [(0.0, 0), *counts]) if n != m]
    settled = {n for t, n in counts if t >= SETTLE_S}
    assert settled == {2}, changes
