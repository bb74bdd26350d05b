"""Two LLM replicas behind the prefix-affinity router: every turn of a conversation finds its earlier turns in the
prefix cache of the replica it lands on (per-replica metrics), and unrelated requests spread over both replicas."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from ray import serve
from ray.serve.config import RequestRouterConfig

from demo.inputs import data_url, make_image
from deployments.encoder.server import Encoder
from deployments.ingress import Ingress
from deployments.ingress.prepare import Preparer
from deployments.llm.router import PrefixAffinityRouter
from deployments.llm.server import LLM
from schemas import AppArgs
from schemas.openai import ChatCompletionRequest
from tests.deployments.instruments import per_replica

pytestmark = pytest.mark.e2e
APP = "route"
SMALL = {"num_cpus": 0.1}
# NOTE: max_imbalance above the 8 conversations in flight: even if they all hash to one replica, none is sent away
# for load (tests/deployments/llm/test_router.py covers that fallback).
REQUESTS = "ray_serve_deployment_request_counter_total"
ROUTER = RequestRouterConfig(request_router_class=PrefixAffinityRouter, request_router_kwargs={"max_imbalance": 16})


@pytest.fixture(scope="module")
def routed(ray_serve, app_args):
    args = {**app_args, "encoder": {"startup_check": False}}
    llm = LLM.options(num_replicas=2, ray_actor_options={"num_cpus": 0.5}, request_router_config=ROUTER).bind(args)
    encoder = Encoder.options(ray_actor_options=SMALL, num_replicas=2, autoscaling_config=None).bind(args)
    serve.run(Ingress.options(ray_actor_options=SMALL).bind(encoder, llm, args), name=APP, route_prefix=f"/{APP}")
    yield f"{ray_serve}/{APP}"
    serve.delete(APP)


def _per_replica(port: int, name: str) -> dict[str, float]:
    # NOTE: Serve counts a finished call of any method as a request, the token channel's too: one that closed for
    # being idle during the test was counted as a 41st request of 40 on a slow machine. A channel is opened outside
    # any request's context (deployments/channel.py), so its calls carry no route; requests carry the app's.
    if name == REQUESTS:
        return per_replica(port, APP, name, route=f"/{APP}")
    return per_replica(port, APP, name)


def _settled(port: int, name: str) -> dict[str, float]:
    """The series once it has stopped moving: a count read while the last test's requests are still being exported
    would charge them to this test."""
    last, deadline = _per_replica(port, name), time.monotonic() + 20
    while time.monotonic() < deadline:
        time.sleep(3.0)  # metrics are reported every second, then scraped: unchanged over several of those
        if (now := _per_replica(port, name)) == last:
            break
        last = now
    return last


def _grown(port: int, before: dict[str, dict[str, float]], want: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per-replica growth of each series since `before`, once the sums reach `want` (metrics arrive every second)."""
    deadline, grown = time.monotonic() + 60, {}
    while time.monotonic() < deadline:
        now = {name: _per_replica(port, name) for name in want}
        grown = {name: {r: v - before[name].get(r, 0.0) for r, v in now[name].items()} for name in want}
        if all(sum(grown[name].values()) >= n for name, n in want.items()):
            break
        time.sleep(0.5)
    return grown


def _conversation(i: int) -> list[list[dict]]:
    """Three turns' messages; an image in the first. The system message differs from the first token on, so no
    KV block is shared between conversations: every prefix hit comes from the conversation's own earlier turns."""
    image = {"type": "image_url", "image_url": {"url": data_url(make_image(224, 168, seed=100 + i))}}
    messages = [
        {"role": "system", "content": f"{i} is your number. You look at pictures."},
        {"role": "user", "content": [image, {"type": "text", "text": f"What is in picture {i}?"}]},
    ]
    turns = [list(messages)]
    for t in (2, 3):
        messages += [
            {"role": "assistant", "content": f"Answer {t - 1}."},
            {"role": "user", "content": f"Tell me more, part {t}."},
        ]
        turns.append(list(messages))
    return turns


def _blocks(prep: Preparer, turns: list[list[dict]]) -> tuple[int, list[int]]:
    """(blocks looked up over the turns, blocks of each turn's prompt that the turn before computed)."""
    bs = prep.args.llm.block_size
    prompts = [prep.prepare(ChatCompletionRequest(messages=m), {}).prompt for m in turns]
    shared = [0]
    for prev, cur in zip(prompts, prompts[1:]):
        common = next((k for k, (a, b) in enumerate(zip(prev, cur)) if a != b), min(len(prev), len(cur)))
        shared.append(common // bs)
    return sum((len(p) - 1) // bs for p in prompts), shared


def test_turns_of_a_conversation_land_on_the_replica_with_their_prefix(routed, app_args, metrics_port):
    conversations = [_conversation(i) for i in range(8)]
    prep = Preparer(AppArgs.model_validate(app_args))
    blocks = [_blocks(prep, c) for c in conversations]
    queries, shared = sum(q for q, _ in blocks), sum(sum(s) for _, s in blocks)
    names = ("ray_vlm_prefix_cache_hits_total", "ray_vlm_prefix_cache_queries_total")
    before = {name: _settled(metrics_port, name) for name in names}

    async def talk(client: httpx.AsyncClient, turns: list[list[dict]]) -> list[int]:
        cached = []
        for messages in turns:  # one turn after the other, as a user would
            body = {"messages": messages, "max_tokens": 2, "temperature": 0}
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        return cached

    async def main():
        async with httpx.AsyncClient(base_url=routed, timeout=120) as client:
            return await asyncio.gather(*(talk(client, c) for c in conversations))

    cached = asyncio.run(main())
    # Each answer says how much of its prompt came from the cache (OpenAI's usage.prompt_tokens_details).
    bs = prep.args.llm.block_size
    assert cached == [[n * bs for n in s] for _, s in blocks]
    grown = _grown(metrics_port, before, {names[0]: shared, names[1]: queries})
    hits, looked_up = grown[names[0]], grown[names[1]]
    rates = {r[-6:]: f"{hits.get(r, 0):.0f}/{n:.0f}" for r, n in looked_up.items()}
    print(f"prefix-cache hits/lookups by replica: {rates}; shared blocks {shared} of {queries}")
    assert sum(looked_up.values()) == queries
    # Every later turn found all of its conversation's earlier blocks; a turn sent to the other replica finds
    # none, so routing at random would come short by about half of them.
    assert sum(hits.values()) == shared, rates


def test_unrelated_requests_spread_over_both_replicas(routed, metrics_port):
    name = REQUESTS
    before = {name: _settled(metrics_port, name)}
    n = 40

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"messages": [{"role": "user", "content": f"Question number {i}: why?"}], "max_tokens": 1}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text

    async def main():
        async with httpx.AsyncClient(base_url=routed, timeout=120) as client:
            for start in range(0, n, 8):
                await asyncio.gather(*(one(client, i) for i in range(start, start + 8)))

    asyncio.run(main())
    counts = _grown(metrics_port, before, {name: n})[name]
    print(f"requests by replica: { {r[-6:]: int(c) for r, c in counts.items()} }")
    # Hashed keys split like fair coins: below 8 of 40 on one replica has odds of about 4e-5; one replica for
    # everything fails at once.
    assert sum(counts.values()) == n and len(counts) == 2 and min(counts.values()) >= 8, counts


def test_no_image_crosses_a_process_of_which_there_is_one(routed, metrics_port):
    """An image goes ingress -> an Encoder replica -> the object store -> an LLM replica, and nothing else: the app
    has no other deployment (the shared EmbeddingCache replica that was there took a call for every image), a request's
    images are one Encoder call, the calls spread over both Encoder replicas and the generations over both LLM
    replicas; sent again, the images are the ingress's cache hits and make no call at all."""
    assert set(serve.status().applications[APP].deployments) == {"Ingress", "Encoder", "LLM"}
    n, deployments = 16, ("Encoder", "LLM")

    def calls() -> dict[str, dict[str, float]]:
        # NOTE: the LLM's token-channel calls carry no route (see _per_replica); the Encoder takes only images
        return {
            "Encoder": per_replica(metrics_port, APP, REQUESTS, deployment="Encoder"),
            "LLM": per_replica(metrics_port, APP, REQUESTS, deployment="LLM", route=f"/{APP}"),
        }

    def grown(before: dict, want: dict[str, int]) -> dict[str, dict[str, float]]:
        """Growth per replica since `before`, once the sums reach `want` and then stop moving (metrics are reported
        every second, then scraped: a call not yet exported would pass for none)."""
        deadline, out, last = time.monotonic() + 60, {}, None
        while time.monotonic() < deadline:
            now = calls()
            out = {
                d: {r: v - before[d].get(r, 0.0) for r, v in now[d].items() if v > before[d].get(r, 0.0)} for d in now
            }
            if all(sum(out[d].values()) >= k for d, k in want.items()):
                if out == last:
                    break
                last = out
                time.sleep(3.0)
                continue
            time.sleep(0.5)
        return out

    def body(i: int) -> dict:
        images = [
            {"type": "image_url", "image_url": {"url": data_url(make_image(84, 56, seed=500 + 2 * i + k))}}
            for k in (0, 1)
        ]
        return {
            "messages": [{"role": "user", "content": [*images, {"type": "text", "text": f"Pair {i}?"}]}],
            "max_tokens": 1,
        }

    async def send():
        async with httpx.AsyncClient(base_url=routed, timeout=120) as client:
            for start in range(0, n, 8):
                rs = await asyncio.gather(
                    *(client.post("/v1/chat/completions", json=body(i)) for i in range(start, start + 8))
                )
                assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]

    before = calls()
    asyncio.run(send())
    first = grown(before, {"Encoder": n, "LLM": n})
    print(f"calls by replica: { {d: {r[-6:]: int(c) for r, c in first[d].items()} for d in deployments} }")
    assert {d: round(sum(first[d].values())) for d in deployments} == {"Encoder": n, "LLM": n}, first
    assert all(len(first[d]) == 2 for d in deployments), first  # both replicas of each: none saw them all
    settled = calls()
    asyncio.run(send())  # the same images: hits
    again = grown(settled, {"LLM": n})
    assert round(sum(again["LLM"].values())) == n and sum(again["Encoder"].values()) == 0, again
