"""Tensor parallelism through the deployed app: an LLM replica of two gloo ranks (itself and an actor in its
placement group) gives transformers' greedy tokens (and those of the one-rank app); a killed rank takes the replica
down cleanly and Serve brings up a new one."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import ray

from deployments import build_app
from llm.tp import check_gpus, llm_placement
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


def test_a_killed_rank_restarts_the_replica_without_hanging_a_request(tp_client, checkpoint, reference):
    before = _ranks()
    assert len(before) == 1, before  # one replica, one rank besides itself
    os.kill(next(iter(before.values())), signal.SIGKILL)
    body = {"messages": openai_messages(CASES["one_image"]), "max_tokens": 4, "temperature": 0}
    statuses, deadline = [], time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            r = tp_client.post("/v1/chat/completions", json=body, timeout=60)  # a hang would raise here
        except httpx.ReadTimeout:
            pytest.fail(f"a request hung after the rank died (statuses so far: {statuses})")
        statuses.append(r.status_code)
        if r.status_code == 200 and len(statuses) > 1:
            break
        assert r.status_code in (200, 503), r.text  # refused while the replica restarts, with Retry-After
        time.sleep(1)
    assert statuses[-1] == 200 and 503 in statuses, statuses
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
    import llm.tp as tp

    monkeypatch.setattr(tp, "get_current_placement_group", lambda: type("PG", (), {"bundle_specs": [{"CPU": 1}] * 2}))
    with pytest.raises(ValueError, match="tensor_parallel_size=4 needs 4 placement_group_bundles .* has 2"):
        tp.Ranks(4, "cpu")
