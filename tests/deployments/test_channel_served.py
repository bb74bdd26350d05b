"""The token channel served (deployments/channel.py): 64 streams at once through one channel, a quarter of them
(asking for 600 tokens) closed by their clients after 3, then the LLM replica killed under load. No token is lost,
no request is stuck, no sequence is left in the engine, and the replica that replaces the dead one gets a channel of
its own."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import ray
from ray import serve

from deployments.encoder.server import Encoder
from deployments.ingress import Ingress
from deployments.llm.server import LLM

pytestmark = pytest.mark.e2e
APP = "channel"
SMALL = {"num_cpus": 0.1}
TOKENS = 24
STREAM = 900  # the killed replica's streams: long enough to be cut (max_model_len 1024)


@pytest.fixture(scope="module")
def url(ray_serve, app_args):
    # A channel stays open for the whole test: every generation after the warm-up goes through it.
    args = {**app_args, "encoder": {"startup_check": False}, "llm": {**app_args["llm"], "token_channel_idle_s": 600}}
    encoder = Encoder.options(ray_actor_options=SMALL, num_replicas=1, autoscaling_config=None).bind(args)
    llm = LLM.options(
        ray_actor_options={"num_cpus": 0.5}, num_replicas=1, autoscaling_config=None, graceful_shutdown_timeout_s=1
    ).bind(args)  # the open channel would hold it up
    serve.run(Ingress.options(ray_actor_options=SMALL).bind(encoder, llm, args), name=APP, route_prefix=f"/{APP}")
    yield f"{ray_serve}/{APP}"
    serve.delete(APP)


def _llm_stats() -> dict:
    return serve.get_deployment_handle("LLM", app_name=APP).stats.remote().result()


def _body(i: int, max_tokens: int = TOKENS) -> dict:
    return {
        "messages": [{"role": "user", "content": f"Stream {i}: count the stars."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }


async def _stream(client: httpx.AsyncClient, body: dict, stop_after: int | None = None) -> tuple[int, list, bool]:
    """(status, token ids, ended properly: a finish reason or an error event, then [DONE]); `stop_after`: the client
    closes the connection after that many chunks with tokens."""
    ids, finished, done = [], False, False
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, ids, True
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                event = json.loads(line[6:])
                finished |= "error" in event or any(c.get("finish_reason") for c in event.get("choices", []))
                ids += [t for c in event.get("choices", []) for t in c.get("token_ids") or []]
                if stop_after is not None and len(ids) >= stop_after:
                    return r.status_code, ids, True
    return r.status_code, ids, finished and done


def _quiet(timeout_s: float = 30) -> dict:
    """The LLM's stats once no sequence is left in it."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = _llm_stats()
        if stats["running"] == 0 and stats["waiting"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def _warm_up(url: str) -> None:
    """One request: it opens this ingress's channel to the replica, for the requests after it."""

    async def one():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            assert (await _stream(client, _body(-1, 2)))[0] == 200

    asyncio.run(one())


def test_64_streams_with_cancellations_through_one_channel(url):
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(
                *(_stream(client, _body(i, 600), 3) if i % 4 == 0 else _stream(client, _body(i)) for i in range(64))
            )

    _warm_up(url)
    before = _llm_stats()
    results = asyncio.run(run())
    assert all(status == 200 and ended for status, _, ended in results), [(s, len(i), e) for s, i, e in results]
    for i, (_, ids, _) in enumerate(results):
        assert len(ids) >= 3 if i % 4 == 0 else len(ids) == TOKENS, (i, len(ids))
    after = _quiet()
    assert after["cancelled"] - before["cancelled"] >= 12  # the 16 closed streams' sequences were cancelled...
    assert after["running"] == after["waiting"] == 0 and after["kv_usage"] < 1.0  # ...and none is left behind
    sent = {k: after[k] - before[k] for k in ("channel_generations", "channel_messages", "stream_messages")}
    assert sent["channel_generations"] == 64 and sent["stream_messages"] == 0, sent
    tokens = sum(len(ids) for _, ids, _ in results)
    assert sent["channel_messages"] * 4 < tokens, (sent, tokens)  # many tokens per message, not one each


def _llm_replica() -> str:
    prefix = f"SERVE_REPLICA::{APP}#LLM#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    assert len(names) == 1, names
    return names[0]


def test_a_killed_llm_replica_ends_its_streams_and_its_successor_gets_a_channel(url):
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            handle = serve.get_deployment_handle("LLM", app_name=APP)
            await handle.stats.remote()  # this process's first call starts its router: before the streams, not during
            tasks = [asyncio.create_task(_stream(client, _body(100 + i, STREAM))) for i in range(16)]
            deadline = time.monotonic() + 60
            while (stats := await handle.stats.remote())["running"] < 16:
                assert not any(t.done() for t in tasks) and time.monotonic() < deadline, stats  # fail, never hang
                await asyncio.sleep(0.1)
            while (await handle.stats.remote())["channel_messages"] < stats["channel_messages"] + 3:
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.1)  # tokens are streaming through the channel: kill mid-stream
            ray.kill(ray.get_actor(killed, namespace="serve"), no_restart=True)
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)  # none stuck

    _warm_up(url)
    killed = _llm_replica()
    results = asyncio.run(run())
    assert all(ended for _, _, ended in results)  # each one an error event (or an error status): none cut short
    assert all(len(ids) < STREAM for _, ids, _ in results)
    deadline = time.monotonic() + 120
    while _llm_replica_or_none() in (None, killed) or "RUNNING" not in _states():
        assert time.monotonic() < deadline, "no new LLM replica"
        time.sleep(0.5)

    async def after():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return [await _stream(client, _body(200 + i, 4)) for i in range(3)]

    assert all(status == 200 and len(ids) == 4 and ended for status, ids, ended in asyncio.run(after()))
    stats = _llm_stats()
    assert stats["channels_opened"] == 1 and stats["channel_generations"] >= 1, stats


def _llm_replica_or_none() -> str | None:
    try:
        return _llm_replica()
    except AssertionError:
        return None


def _states() -> dict[str, int]:
    return serve.status().applications[APP].deployments["LLM"].replica_states


def test_the_client_whose_request_opened_the_channel_leaving_closes_nothing(ray_serve, app_args):
    """The channel is opened by whichever generation first meets the replica without one; that request's client
    leaving must not take the channel with it: Serve cancels a cancelled request's calls, and the channel was once
    one of them, so every stream attached to it failed (a 503 before the first token, an error event after)."""
    app = "channel_owner"
    args = {**app_args, "encoder": {"startup_check": False}, "llm": {**app_args["llm"], "token_channel_idle_s": 600}}
    encoder = Encoder.options(ray_actor_options=SMALL, num_replicas=1, autoscaling_config=None).bind(args)
    llm = LLM.options(
        ray_actor_options={"num_cpus": 0.5}, num_replicas=1, autoscaling_config=None, graceful_shutdown_timeout_s=1
    ).bind(args)
    serve.run(Ingress.options(ray_actor_options=SMALL).bind(encoder, llm, args), name=app, route_prefix=f"/{app}")
    handle = serve.get_deployment_handle("LLM", app_name=app)

    async def run():
        async with httpx.AsyncClient(base_url=f"{ray_serve}/{app}", timeout=120) as client:
            opener = asyncio.create_task(_stream(client, _body(300, 600), 10**6))  # opens the channel, then leaves
            while (await handle.stats.remote())["channels_opened"] < 1:
                await asyncio.sleep(0.05)
            riders = [asyncio.create_task(_stream(client, _body(301 + i))) for i in range(4)]
            while (await handle.stats.remote())["channel_generations"] < 4:
                await asyncio.sleep(0.05)  # the others are attached to the channel
            opener.cancel()  # its client closes the connection
            return await asyncio.wait_for(asyncio.gather(*riders), 60)

    try:
        results = asyncio.run(run())
        assert [(status, len(ids), ended) for status, ids, ended in results] == [(200, TOKENS, True)] * 4
        stats = handle.stats.remote().result()
        assert stats["channels_opened"] == 1 and stats["stream_messages"] > 0, stats  # the opener came by its own
    finally:
        serve.delete(app)
