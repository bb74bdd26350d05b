"""Tensor parallelism through the deployed app: an LLM replica of two gloo ranks (itself and an actor in its
placement group) gives transformers' greedy tokens (and those of the one-rank app); a rank killed under load ends
its replica's requests cleanly (200, 503 + Retry-After, or a stream's error event) and Serve brings up a new one."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import ray
from ray import serve

from deployments.app import build_app
from deployments.llm.tp import check_gpus, llm_placement
from tests.deployments.parity import CASES, MAX_TOKENS, assert_greedy_equals_reference, deployed, openai_messages

pytestmark = pytest.mark.timeout(600)


def _ranks() -> dict[str, int]:
    """Live tensor-parallel rank actors: actor id -> pid."""
    return {
        aid: a["Pid"]
        for aid, a in ray._private.state.actors().items()
        if a["ActorClassName"] == "Rank" and a["State"] == "ALIVE"
    }


@pytest.fixture(scope="module")
def tp_client(ray_serve, app_args, checkpoint):
    with deployed(
        ray_serve, {**app_args, "llm": {**app_args["llm"], "tensor_parallel_size": 2}}, checkpoint, "tp"
    ) as client:
        yield client


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_the_reference_tokens(tp_client, checkpoint, reference, case):
    assert_greedy_equals_reference(tp_client, checkpoint, reference, CASES[case])


def test_two_ranks_answer_like_one(tp_client, client):
    body = {
        "messages": openai_messages(CASES["two_turns"]),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
        "n": 2,
    }
    one, two = client.post("/v1/chat/completions", json=body), tp_client.post("/v1/chat/completions", json=body)
    assert one.status_code == two.status_code == 200, two.text
    assert [c["token_ids"] for c in two.json()["choices"]] == [c["token_ids"] for c in one.json()["choices"]]


async def _one(client: httpx.AsyncClient, i: int) -> str:
    """One request of the load, streamed when i is odd: how it ended ("200", "503", "stream error", "stream
    done"); anything else fails the test."""
    body = {"messages": [{"role": "user", "content": f"count {i}"}], "max_tokens": 200, "ignore_eos": True}
    if i % 2 == 0:
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code in (200, 503), (r.status_code, r.text)  # never another 5xx
        assert r.status_code == 200 or r.headers.get("retry-after"), r.headers
        return str(r.status_code)
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, await r.aread())
            return "503"
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]  # a stream under way ends with [DONE], error or not
    return "stream error" if any('"error"' in e for e in events[:-1]) else "stream done"


async def _running() -> int:
    return (await serve.get_deployment_handle("LLM", app_name="tp").stats.remote())["running"]


def test_a_killed_rank_under_load_ends_every_request_cleanly_and_the_replica_restarts(tp_client, checkpoint, reference):
    """Six requests in a closed loop (half streamed); the rank is killed once sequences run on it (state, not a
    sleep). Every request ends 200, 503 with Retry-After, or a stream with an error event and [DONE], none hangs;
    then a new replica with new ranks answers like the reference."""
    before = _ranks()
    assert len(before) == 1, before  # one replica, one rank besides itself

    async def load() -> list[str]:
        async with httpx.AsyncClient(base_url=str(tp_client.base_url), timeout=120) as client:
            tasks = [asyncio.create_task(_one(client, i)) for i in range(6)]
            deadline = time.monotonic() + 60
            while await _running() == 0:
                assert time.monotonic() < deadline, "no sequence ever ran"
                await asyncio.sleep(0.05)
            os.kill(next(iter(before.values())), signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 180)  # a hang fails here

    ended = asyncio.run(load())
    assert set(ended) <= {"200", "503", "stream error", "stream done"} and set(ended) & {"503", "stream error"}, ended
    body = {"messages": openai_messages(CASES["one_image"]), "max_tokens": 4, "temperature": 0}
    statuses, deadline = [], time.monotonic() + 300
    while time.monotonic() < deadline:
        try:  # NOTE: once the dead replica is stopped, a request waits in Serve's router for its successor to start
            r = tp_client.post("/v1/chat/completions", json=body, timeout=240)  # a hang would raise here
        except httpx.ReadTimeout:
            pytest.fail(f"a request hung after the rank died (statuses so far: {statuses})")
        statuses.append(r.status_code)
        if r.status_code == 200:
            break
        assert r.status_code == 503 and r.headers.get("retry-after"), r.text  # refused while the replica restarts
        time.sleep(1)
    assert statuses[-1] == 200, statuses
    after = _ranks()
    assert len(after) == 1 and not set(after) & set(before), (before, after)  # a new replica, new ranks
    assert_greedy_equals_reference(tp_client, checkpoint, reference, CASES["one_image"])


def test_placement_packs_the_ranks_and_checks_the_gpus(ray_serve):  # a cluster with no GPUs
    assert llm_placement(1, "cpu") == {}
    assert llm_placement(2, "cpu") == {
        "placement_group_bundles": [{"CPU": 1}] * 2,
        "placement_group_strategy": "STRICT_PACK",
    }
    check_gpus(4, [2, 4])
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 needs 4 GPUs on one node .* nodes have 2, 2 GPUs"):
        check_gpus(4, [2, 2])
    with pytest.raises(ValueError, match="needs 2 GPUs on one node"):
        llm_placement(2, "cuda")  # this cluster has none


def test_a_size_that_does_not_split_the_model_fails_at_build(app_args):
    with pytest.raises(
        ValueError,
        match="llm.tensor_parallel_size: tensor_parallel_size=3 does not divide the model's 4 attention heads",
    ):
        build_app({**app_args, "llm": {"tensor_parallel_size": 3}})


def test_too_few_bundles_for_the_ranks_is_said_plainly(monkeypatch):
    import deployments.llm.tp as tp

    monkeypatch.setattr(tp, "get_current_placement_group", lambda: type("PG", (), {"bundle_specs": [{"CPU": 1}] * 2}))
    with pytest.raises(ValueError, match="tensor_parallel_size=4 needs 4 placement_group_bundles .* has 2"):
        tp.Ranks(4, "cpu")


def test_qwen3_vl_over_two_ranks_gives_the_reference_tokens(ray_serve, app_args, tmp_path_factory):
    """Qwen3-VL through the tier into an LLM replica of two gloo ranks: each rank gets the step's DeepStack levels
    with its embeddings (llm/model/parallel.py), and the greedy tokens are transformers'."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from demo.tiny_qwen3_vl import build_qwen3_vl_checkpoint

    # NOTE: seed 2, as the engine's Qwen3-VL tests: its DeepStack levels move the greedy tokens
    ckpt = build_qwen3_vl_checkpoint(tmp_path_factory.mktemp("qwen3-tp") / "qwen3-vl-tiny", seed=2)
    reference = Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    args = {**app_args, "llm": {**app_args["llm"], "tensor_parallel_size": 2}}
    with deployed(ray_serve, args, ckpt, "qwen3-tp") as client:
        for case in ("one_image", "two_turns"):
            assert_greedy_equals_reference(client, ckpt, reference, CASES[case])
