"""Encoder replicas dying and scaling: the caller owns embeddings, lost images are retried, nothing hangs or is lost,
and the encoder deployment scales up under an image burst and back down after it."""

from __future__ import annotations

import asyncio
import functools
import time

import httpx
import pytest
import ray
from ray import serve

from deployments.ingress import Ingress
from encoders.server import Encoder
from llm.server import LLM
from tests.deployments.instruments import SlowEncoder, forwards
from tests.helpers import data_url, image_bytes, make_image

pytestmark = pytest.mark.e2e
SMALL = {"num_cpus": 0.1}  # these apps share the session's logical CPUs with the others


def _app(app_args, record_dir: str, delay_s: float, **encoder_options):
    # Every request really encodes; no start-up forward, which the slow encoder would record as a served one.
    args = {**app_args, "encoder": {"cache_gib": 0, "startup_check": False}}
    encoder = Encoder.options(ray_actor_options=SMALL, **encoder_options).bind(
        args, None, model_factory=functools.partial(SlowEncoder, delay_s=delay_s, record_dir=record_dir))
    return Ingress.options(ray_actor_options=SMALL).bind(
        encoder, LLM.options(ray_actor_options=SMALL).bind(args), args)


def _replicas(app: str) -> list[str]:
    prefix = f"SERVE_REPLICA::{app}#Encoder#"
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


def _states(app: str) -> dict[str, int]:
    return serve.status().applications[app].deployments["Encoder"].replica_states


def _running(app: str) -> int:
    return _states(app).get("RUNNING", 0)


def _recovered(app: str, killed: list[str]) -> bool:
    """Serve noticed the kills: two replicas, none of them a killed one, both running."""
    names = _replicas(app)
    return len(names) == 2 and not set(names) & set(killed) and _running(app) == 2


def _wait(condition, timeout_s: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "timed out"
        time.sleep(0.2)
    return time.monotonic() - start


def _body(i: int, images: int = 1) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(make_image(56 + 28 * (i % 4), 56, seed=i))}}
             for _ in range(images)]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": f"q{i}"}]}],
            "max_tokens": 2, "temperature": 0, "stream": i % 2 == 1}


async def _post(client: httpx.AsyncClient, body: dict) -> tuple[int, str | None, str]:
    r = await client.post("/v1/chat/completions", json=body)
    return r.status_code, r.headers.get("retry-after"), r.text


@pytest.fixture(scope="module")
def faults(ray_serve, app_args, tmp_path_factory):
    record_dir = str(tmp_path_factory.mktemp("forwards"))
    serve.run(_app(app_args, record_dir, 0.6, num_replicas=2, autoscaling_config=None), name="faults",
              route_prefix="/faults")
    yield f"{ray_serve}/faults"
    serve.delete("faults")


def test_embeddings_outlive_the_replicas_that_made_them(faults):
    """The caller owns what a replica returns: kill every encoder replica, the embedding is still there."""
    handle = serve.get_deployment_handle("Encoder", app_name="faults")

    async def encode():
        ref = await handle.encode.remote(image_bytes(make_image(84, 56, seed=1)))._to_object_ref()
        return ref, await ref

    ref, embeds = asyncio.run(encode())
    killed = _replicas("faults")
    assert len(killed) == 2
    for name in killed:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    assert ray.get(ref, timeout=30).equal(embeds)
    _wait(lambda: _recovered("faults", killed), 90)


def test_killed_replica_under_load(faults):
    """Kill one of two encoder replicas while requests are in flight: each request gets a 200 or a 503 with
    Retry-After (none hangs, none is a 500), the lost images are re-encoded, and after recovery all succeed."""
    ingress = serve.get_deployment_handle("Ingress", app_name="faults")
    before = ingress.stats.remote().result()

    killed = []

    async def burst(n: int, kill_after_s: float | None):
        async with httpx.AsyncClient(base_url=faults, timeout=90) as client:
            tasks = [asyncio.create_task(_post(client, _body(i, images=1 + i % 2))) for i in range(n)]
            if kill_after_s is not None:
                await asyncio.sleep(kill_after_s)
                killed.append(_replicas("faults")[0])
                ray.kill(ray.get_actor(killed[0], namespace="serve"), no_restart=True)
            return await asyncio.gather(*tasks)

    results = asyncio.run(burst(16, kill_after_s=1.0))
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 503}, [r for r in results if r[0] not in (200, 503)]
    assert all(retry is not None for s, retry, _ in results if s == 503)
    after = ingress.stats.remote().result()
    assert after["encoder_retries"] > before["encoder_retries"], (statuses, after)  # the kill hit work in flight
    print(f"under a replica kill: {statuses.count(200)} x 200, {statuses.count(503)} x 503, "
          f"{after['encoder_retries'] - before['encoder_retries']} images re-encoded")
    _wait(lambda: _recovered("faults", killed), 90)
    assert [s for s, _, _ in asyncio.run(burst(8, kill_after_s=None))] == [200] * 8


@pytest.fixture(scope="module")
def scaling(ray_serve, app_args, tmp_path_factory):
    record_dir = str(tmp_path_factory.mktemp("forwards"))
    # The settings serve_config.yaml documents, with shorter look-back so that the test is quick.
    autoscaling = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2, "upscale_delay_s": 1,
                   "downscale_delay_s": 4, "metrics_interval_s": 0.5, "look_back_period_s": 2}
    serve.run(_app(app_args, record_dir, 0.4, autoscaling_config=autoscaling, max_ongoing_requests=4),
              name="scaling", route_prefix="/scaling")
    yield f"{ray_serve}/scaling", record_dir
    serve.delete("scaling")


def test_scales_up_under_an_image_burst_and_down_after(scaling):
    url, record_dir = scaling
    assert _running("scaling") == 1
    peak, asked_at, scaled_at = 0, None, None
    stop_at = time.time() + 120  # a cap: the load goes on until a second replica has served, however slow its start

    async def client_loop(client, worker: int) -> list[int]:
        statuses = []
        while time.time() < stop_at:
            statuses.append((await _post(client, _body(1000 * worker + len(statuses), images=2)))[0])
        return statuses

    def a_new_replica_served() -> bool:
        rows = forwards(record_dir)
        return bool(rows) and any(pid != rows[0][0] for pid, _, _ in rows)

    async def load():
        nonlocal peak, asked_at, scaled_at, stop_at
        async with httpx.AsyncClient(base_url=url, timeout=90) as client:
            tasks = [asyncio.create_task(client_loop(client, w)) for w in range(12)]
            while not all(t.done() for t in tasks):
                states = _states("scaling")
                peak = max(peak, states.get("RUNNING", 0))
                if asked_at is None and sum(states.values()) >= 2:
                    asked_at = time.time()
                if scaled_at is None and peak >= 2:
                    scaled_at = time.time()
                if scaled_at is not None and stop_at > time.time() + 2 and a_new_replica_served():
                    stop_at = time.time() + 2
                await asyncio.sleep(0.25)
            return [s for t in tasks for s in t.result()]

    start = time.time()
    statuses = asyncio.run(load())
    ended = time.monotonic()
    assert statuses and set(statuses) == {200}, statuses
    rows = forwards(record_dir)
    new = [t for pid, t, _ in rows if pid != rows[0][0]]  # rows[0]: the one replica there was at the start
    assert peak >= 2 and new, f"did not scale up: peak {peak} replicas"
    print(f"scale-up after the load step: a second replica asked for at {asked_at - start:.1f} s, running at "
          f"{scaled_at - start:.1f} s, serving at {new[0] - start:.1f} s; peak {peak} replicas")
    down = _wait(lambda: _running("scaling") == 1, 60)
    print(f"scale-down: back to 1 replica {time.monotonic() - ended:.1f} s after the load ended ({down:.1f} s waited)")
