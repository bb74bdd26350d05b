"""The encoder tier in the running app: the ingress's embedding cache (a hit is no encoder call, and keys that tell
images and tenants apart), and colocated mode against the reference."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from PIL import Image
from ray import serve

from demo.inputs import data_url, image_bytes, make_image
from tests.deployments.parity import CASES, MAX_TOKENS, openai_messages, reference_generate

pytestmark = pytest.mark.e2e


def _ask(client: httpx.Client, conversation, url: str = "/v1/chat/completions") -> list[int]:
    body = {
        "messages": openai_messages(conversation),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    r = client.post(url, json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _cache_stats() -> dict[str, int]:
    """The ingress's embedding cache (the app has one ingress replica)."""
    stats = serve.get_deployment_handle("Ingress", app_name="vlm").stats.remote().result()
    return {k.removeprefix("cache_"): v for k, v in stats.items() if k.startswith("cache_")}


def test_cache_keys_on_size_not_only_bytes(client, checkpoint, reference):
    """A 30x100 and a 100x30 image made of the same pixel bytes are two entries; re-sent, both are hits, and
    each answer is its own image's reference answer."""
    raw = np.random.default_rng(7).integers(0, 256, 30 * 100 * 3, dtype=np.uint8).tobytes()
    images = {"tall": Image.frombytes("RGB", (30, 100), raw), "wide": Image.frombytes("RGB", (100, 30), raw)}
    convs = {name: [("user", [im, "What is this?"])] for name, im in images.items()}
    before = _cache_stats()
    first = {name: _ask(client, conv) for name, conv in convs.items()}
    middle = _cache_stats()
    again = {name: _ask(client, conv) for name, conv in convs.items()}
    after = _cache_stats()
    assert (middle["misses"] - before["misses"], middle["hits"] - before["hits"]) == (2, 0)
    assert (after["misses"] - middle["misses"], after["hits"] - middle["hits"]) == (0, 2)
    assert again == first
    for name, conv in convs.items():
        assert first[name] == reference_generate(checkpoint, reference, conv)[1], name


def test_second_turn_reuses_first_turn_embeddings(client):
    image = make_image(160, 120, seed=11)
    turn1 = [("user", [image, "Describe it."])]
    before = _cache_stats()
    answer = _ask(client, turn1)
    turn2 = [*turn1, ("assistant", [f"tokens {answer[:3]}"]), ("user", ["And again?", make_image(64, 64, seed=12)])]
    _ask(client, turn2)
    after = _cache_stats()
    assert after["hits"] - before["hits"] == 1  # the first turn's image; the new one is a miss
    assert after["misses"] - before["misses"] == 2
    assert after["bytes"] <= after["max_bytes"]


def test_cache_salts_scope_both_caches(client):
    """The same image and text under two cache_salts: the second is a miss in the embedding cache and finds no
    prefix KV; the first salt again: a hit in both."""
    image = make_image(96, 64, seed=21)

    def ask(salt: str) -> int:
        body = {"messages": openai_messages([("user", [image, "Salted?"])]), "max_tokens": 2, "cache_salt": salt}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    stats = [_cache_stats()]
    cached = []
    for salt in ("tenant-1", "tenant-2", "tenant-1"):
        cached.append(ask(salt))
        stats.append(_cache_stats())
    deltas = [(b["misses"] - a["misses"], b["hits"] - a["hits"]) for a, b in zip(stats, stats[1:], strict=False)]
    assert deltas == [(1, 0), (1, 0), (0, 1)], deltas
    assert cached[0] == cached[1] == 0 < cached[2], cached


@pytest.fixture(scope="module")
def colocated(tools_app):
    """The session's colocated app (tests/conftest.py: its LLM replica encodes the images itself), and its checkpoint:
    the session's weights, with a chat template that also renders tools (none here)."""
    client, checkpoint = tools_app
    return str(client.base_url).rstrip("/"), checkpoint


@pytest.mark.parametrize("case", ["one_image", "three_images", "two_turns"])
def test_colocated_equals_transformers(colocated, case, reference):
    url, checkpoint = colocated  # transformers' processor renders its template; the weights are the reference's
    with httpx.Client(base_url=url, timeout=60) as client:
        assert _ask(client, CASES[case]) == reference_generate(checkpoint, reference, CASES[case])[1]


def test_colocated_bad_image_is_a_400(colocated):
    """Header fine, pixels truncated: the LLM replica's own decode fails, and that is the client's 400."""
    colocated, _ = colocated
    png = image_bytes(make_image(200, 150, seed=3))
    part = {"type": "image_url", "image_url": {"url": data_url(png[: len(png) // 2])}}
    r = httpx.post(
        f"{colocated}/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}]}, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "could not be decoded" in r.json()["error"]["message"]
    assert httpx.get(f"{colocated}/health", timeout=10).status_code == 200
    assert set(serve.status().applications["tools"].deployments) == {"Ingress", "LLM"}  # no encoder tier
