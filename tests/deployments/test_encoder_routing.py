"""The Encoder deployment routes on cost in the running app: with a big image in flight on one replica, the images
of the next request go to the other one (on request counts, about every second one would wait behind it); on a
saturated CPU no call is lost and both replicas work. (The ingress's log of the routers' late probes, one line a
minute, is tested in tests/deployments/test_errors.py: this machine's saturation does not reliably make them.)"""

from __future__ import annotations

import asyncio
import functools
import subprocess
import sys

import httpx
import pytest
from ray import serve

from demo.inputs import data_url, make_image
from deployments.encoder.server import Encoder
from deployments.ingress import Ingress
from deployments.llm.server import LLM
from tests.deployments.instruments import SlowEncoder, forwards_started

pytestmark = pytest.mark.e2e
SMALL = {"num_cpus": 0.1}  # these apps share the session's logical CPUs with the others


@pytest.fixture(scope="module")
def routed(ray_serve, app_args, tmp_path_factory):
    record_dir = str(tmp_path_factory.mktemp("forwards"))
    args = {**app_args, "encoder": {"cache_gib": 0, "startup_check": False}}  # every image really encodes
    slow = functools.partial(SlowEncoder, delay_s=1.5, record_dir=record_dir)
    encoder = Encoder.options(ray_actor_options=SMALL, num_replicas=2, autoscaling_config=None).bind(
        args, model_factory=slow
    )
    llm = LLM.options(ray_actor_options=SMALL).bind(args)
    serve.run(Ingress.options(ray_actor_options=SMALL).bind(encoder, llm, args), name="routed", route_prefix="/routed")
    yield f"{ray_serve}/routed", record_dir
    serve.delete("routed")


def _body(images: list) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}], "max_tokens": 2}


def test_small_images_go_around_a_big_one_in_flight(routed):
    url, record_dir = routed

    async def main() -> str:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            big = asyncio.create_task(client.post("/v1/chat/completions", json=_body([make_image(448, 448, seed=1)])))
            while not (started := forwards_started(record_dir)):  # the big image's forward is running
                assert not big.done(), big.result().text
                await asyncio.sleep(0.02)
            smalls = [make_image(56, 56, seed=10 + i) for i in range(4)]
            r = await client.post("/v1/chat/completions", json=_body(smalls))
            assert r.status_code == 200, r.text
            assert (await big).status_code == 200
            return next(iter(started))

    big_replica = asyncio.run(main())
    started = forwards_started(record_dir)
    assert started[big_replica] == 1 and len(started) == 2, started  # the four small images all ran elsewhere


def test_a_saturated_cpu_loses_no_call_and_routes_to_both_replicas(routed):
    """Busy loops on every core while 32 requests of two images each go through: every one answers, and both
    replicas encode (a replica that answers late is left out of one choice, not of the routing)."""
    url, record_dir = routed
    before = forwards_started(record_dir)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(6)]
    try:

        async def main() -> list[int]:
            async with httpx.AsyncClient(base_url=url, timeout=300) as client:
                gate = asyncio.Semaphore(16)

                async def one(i: int) -> int:
                    async with gate:
                        images = [make_image(56 + i, 56, seed=100 + 2 * i + k) for k in range(2)]
                        return (await client.post("/v1/chat/completions", json=_body(images))).status_code

                return await asyncio.gather(*(one(i) for i in range(32)))

        statuses = asyncio.run(main())
    finally:
        for b in burners:
            b.kill()
    assert statuses == [200] * 32
    after = forwards_started(record_dir)
    assert all(after.get(r, 0) > before.get(r, 0) for r in after) and len(after) == 2, (before, after)
