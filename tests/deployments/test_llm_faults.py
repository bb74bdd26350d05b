"""An LLM replica lost with requests in flight before their first token: each is sent once more, to another replica
when one is alive (200), else answered 503 with Retry-After; never a 500, never a hang. The kill is triggered on state
(every request held in a replica), not on a sleep. A request that arrives while no LLM replica is alive (its
successor still starting) is a 503 with Retry-After in bounded time too, not a wait until its deadline."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve

from deployments.channel import ROUTE_TIMEOUT_S
from deployments.ingress import Ingress
from deployments.llm.server import LLM

pytestmark = pytest.mark.e2e
APP = "llmfaults"
SMALL = {"num_cpus": 0.1}


class HoldingLLM(LLM.func_or_class):
    """The LLM deployment, which holds each generation before its first chunk while `<record_dir>/hold` exists,
    having recorded (replica actor name, request id): a request in flight there, with nothing sent yet."""

    def __init__(self, args, model_factory=None, *, record_dir: str):
        super().__init__(args, model_factory)
        self.record_dir, self.actor = Path(record_dir), ray.get_runtime_context().get_actor_name()

    async def generate(self, request, media=None):
        if (self.record_dir / "hold").exists():
            with open(self.record_dir / f"{os.getpid()}.held", "a") as f:
                f.write(f"{self.actor} {request.request_id}\n")
            while (self.record_dir / "hold").exists():
                await asyncio.sleep(0.02)
        async for item in super().generate(request, media):
            yield item


def _held(record_dir: Path) -> Counter:
    """Generations held so far, by replica actor name."""
    return Counter(line.split()[0] for f in record_dir.glob("*.held") for line in f.read_text().splitlines())


@pytest.fixture(scope="module")
def held_app(ray_serve, app_args, tmp_path_factory):
    record_dir = tmp_path_factory.mktemp("held")
    args = {**app_args, "encoder": {"colocated": True}}
    llm = LLM.options(
        func_or_class=HoldingLLM, num_replicas=2, autoscaling_config=None, ray_actor_options={"num_cpus": 0.5}
    ).bind(args, record_dir=str(record_dir))
    serve.run(Ingress.options(ray_actor_options=SMALL).bind(None, llm, args), name=APP, route_prefix=f"/{APP}")
    yield f"{ray_serve}/{APP}", record_dir
    serve.delete(APP)


def _body(i: int) -> dict:
    return {
        "messages": [{"role": "user", "content": f"question {i}"}],
        "max_tokens": 3,
        "temperature": 0,
        "stream": i % 2 == 1,
    }


def _llm_replicas(app: str = APP) -> list[str]:
    prefix = f"SERVE_REPLICA::{app}#LLM#"
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


async def _burst_and_kill(url: str, record_dir: Path, n: int, kill_all: bool) -> tuple[list, list[str], int]:
    """n requests held in the LLM replicas; kill the busiest replica (or every one), then let the rest go.
    Returns (status, Retry-After, body) per request, the replicas killed, and how many requests they held."""
    (record_dir / "hold").touch()
    before = _held(record_dir)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        tasks = [asyncio.create_task(client.post("/v1/chat/completions", json=_body(i))) for i in range(n)]
        deadline = time.monotonic() + 60
        while (held := _held(record_dir) - before).total() < n:
            assert time.monotonic() < deadline, f"only {held} held"
            await asyncio.sleep(0.02)
        killed = sorted(held) if kill_all else [held.most_common(1)[0][0]]
        for name in killed:
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        (record_dir / "hold").unlink()
        responses = await asyncio.gather(*tasks)
    return [(r.status_code, r.headers.get("retry-after"), r.text) for r in responses], killed, held


def _stats(app: str = APP) -> dict:
    return serve.get_deployment_handle("Ingress", app_name=app).stats.remote().result()


def _wait_running(n: int, timeout_s: float = 120, app: str = APP) -> None:
    deadline = time.monotonic() + timeout_s
    while serve.status().applications[app].deployments["LLM"].replica_states.get("RUNNING", 0) != n:
        assert time.monotonic() < deadline, serve.status().applications[app].deployments["LLM"]
        time.sleep(0.2)


def test_requests_of_a_killed_llm_replica_end_200_on_the_other(held_app):
    url, record_dir = held_app
    before = _stats()
    results, killed, held = asyncio.run(_burst_and_kill(url, record_dir, 8, kill_all=False))
    statuses = [s for s, _, _ in results]
    assert statuses == [200] * 8, [r for r in results if r[0] != 200]
    assert all(text.rstrip().endswith("data: [DONE]") for i, (_, _, text) in enumerate(results) if i % 2)
    # every request the killed replica held was sent once more (and none of the others)
    assert _stats()["llm_retries"] - before["llm_retries"] == held[killed[0]] > 0, (held, killed)


def test_with_no_llm_replica_alive_the_retry_is_a_503_in_bounded_time(held_app):
    url, record_dir = held_app
    _wait_running(2)  # the previous test's kill, replaced
    started = time.monotonic()
    results, _, _ = asyncio.run(_burst_and_kill(url, record_dir, 6, kill_all=True))
    took = time.monotonic() - started
    # A replacement replica may come up within the retry's wait on a fast machine: then 200. Never a 500.
    assert {s for s, _, _ in results} <= {200, 503}, results
    lost = [(retry, text) for s, retry, text in results if s == 503]
    assert all(retry and ("replica_lost" in text or "no LLM replica" in text) for retry, text in lost), lost
    assert took < 60 + ROUTE_TIMEOUT_S, took  # bounded: the wait for the hold, then the retry's wait
    _wait_running(2)


class StartingLLM(LLM.func_or_class):
    """The LLM deployment, whose replicas that start while `<record_dir>/hold` exists stay in their constructor until
    it goes, having written `<pid>.starting`: the successor of a lost replica that cannot serve yet."""

    def __init__(self, args, model_factory=None, *, record_dir: str):
        hold = Path(record_dir) / "hold"
        if hold.exists():
            (Path(record_dir) / f"{os.getpid()}.starting").touch()
            while hold.exists():
                time.sleep(0.05)
        super().__init__(args, model_factory)


UNAVAILABLE, DEADLINE_S = "llmstarting", 60.0  # a deadline well past the route's bound


@pytest.fixture(scope="module")
def starting_app(ray_serve, app_args, tmp_path_factory):
    record_dir = tmp_path_factory.mktemp("starting")
    limits = {**app_args["limits"], "request_timeout_s": DEADLINE_S}
    args = {**app_args, "limits": limits, "encoder": {"colocated": True}}
    llm = LLM.options(
        func_or_class=StartingLLM, num_replicas=1, autoscaling_config=None, ray_actor_options={"num_cpus": 0.5}
    ).bind(args, record_dir=str(record_dir))
    ingress = Ingress.options(ray_actor_options=SMALL).bind(None, llm, args)
    serve.run(ingress, name=UNAVAILABLE, route_prefix=f"/{UNAVAILABLE}")
    yield f"{ray_serve}/{UNAVAILABLE}", record_dir
    (record_dir / "hold").unlink(missing_ok=True)
    serve.delete(UNAVAILABLE)


async def _post_all(url: str, n: int) -> list[tuple[int, str | None, str, float]]:
    """n requests at once (half streaming): (status, Retry-After, body, seconds) each."""

    async def one(client: httpx.AsyncClient, i: int):
        started = time.monotonic()
        r = await client.post("/v1/chat/completions", json=_body(i))
        return r.status_code, r.headers.get("retry-after"), r.text, time.monotonic() - started

    async with httpx.AsyncClient(base_url=url, timeout=2 * DEADLINE_S) as client:
        return await asyncio.gather(*(one(client, i) for i in range(n)))


def test_a_request_that_finds_no_llm_replica_alive_is_a_503_before_its_deadline(starting_app):
    """The one LLM replica is lost and its successor is still starting: a new request (no retry: its first attempt)
    is a 503 with Retry-After once the route's bound has passed, not a 408 at its deadline; the app then serves."""
    url, record_dir = starting_app
    before = _stats(UNAVAILABLE)
    (record_dir / "hold").touch()
    [name] = _llm_replicas(UNAVAILABLE)
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    deadline = time.monotonic() + 120
    while not list(record_dir.glob("*.starting")):  # the successor is in its constructor: none alive
        assert time.monotonic() < deadline, serve.status().applications[UNAVAILABLE].deployments["LLM"]
        time.sleep(0.05)
    results = asyncio.run(_post_all(url, 4))
    assert [s for s, _, _, _ in results] == [503] * 4, results
    assert all(retry and "no LLM replica took the request" in text for _, retry, text, _ in results), results
    assert max(t for _, _, _, t in results) < DEADLINE_S - 10, results  # the route's bound, not the deadline
    assert _stats(UNAVAILABLE)["llm_retries"] == before["llm_retries"]  # their first attempt said so
    (record_dir / "hold").unlink()
    _wait_running(1, app=UNAVAILABLE)
    assert httpx.post(f"{url}/v1/chat/completions", json=_body(0), timeout=60).status_code == 200
