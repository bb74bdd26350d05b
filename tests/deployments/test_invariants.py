"""Design invariants that only show in the running app: the ingress never holds embeddings; cancellation frees."""

from __future__ import annotations

import functools
import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
import ray
import torch
from ray import serve

from demo.build_tiny import build_checkpoint
from demo.inputs import data_url, make_image
from demo.tiny_qwen3_vl import build_qwen3_vl_checkpoint
from deployments.encoder.server import Encoder
from deployments.ingress import Ingress
from deployments.llm.server import LLM
from schemas import GenerateRequest, MediaItem, SamplingParams
from tests.deployments.instruments import (
    FaultyLM,
    LocatingLLM,
    TracingEncoder,
    deserializations,
    inline_limit,
    locations,
)
from tests.helpers import leave_mid_stream

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def instrumented(ray_serve, app_args):
    """A second app at /traced: its LM fails at position 40."""
    serve.run(
        Ingress.bind(Encoder.bind(app_args), LLM.bind(app_args, model_factory=FaultyLM.load), app_args),
        name="traced",
        route_prefix="/traced",
    )
    yield f"{ray_serve}/traced"
    serve.delete("traced")


@pytest.fixture(scope="module")
def big_images(tmp_path_factory):
    """A checkpoint like the session's that takes images of up to 1024 merged tokens, and two images whose
    embeddings (462 tokens x 64 float32 = 118 KiB each) are over Ray's inline limit."""
    checkpoint = build_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "qwen2-vl-tiny-1024", seed=0, max_pixels=28 * 28 * 1024
    )
    images = [make_image(616, 588, seed=20 + i) for i in range(2)]  # 44 x 42 patches: 462 tokens each
    return checkpoint, images, 462 * 64 * 4


@pytest.fixture(scope="module", params=[0, 0.05], ids=["cache_off", "cache_on"])
def through_the_store(request, ray_serve, app_args, big_images, tmp_path_factory):
    """An app at /store whose encoder's outputs record who unpickles them and whose LLM records where they live."""
    checkpoint, _, _ = big_images
    record_dir = str(tmp_path_factory.mktemp("store"))
    args = {
        **app_args,
        "model": str(checkpoint),
        "llm": {"max_model_len": 2048},
        "encoder": {"cache_gib": request.param, "startup_check": False},
    }
    encoder = Encoder.bind(args, model_factory=functools.partial(TracingEncoder, record_dir=record_dir))
    llm = LLM.options(func_or_class=LocatingLLM).bind(args, record_dir=record_dir)
    serve.run(Ingress.bind(encoder, llm, args), name="store", route_prefix="/store")
    yield f"{ray_serve}/store", record_dir, request.param > 0
    serve.delete("store")


def test_embeddings_go_through_the_object_store_never_the_ingress(through_the_store, big_images):
    """Embeddings over Ray's inline limit: the LLM is sent refs of objects that live in a node's object store, and
    the ingress never deserializes one; with the cache on, the repeated images are the first request's refs,
    which the ingress kept (no encoder call, no copy)."""
    url, record_dir, cached = through_the_store
    _, images, embed_bytes = big_images
    assert embed_bytes > inline_limit()
    parts = [{"type": "image_url", "image_url": {"url": data_url(im, fmt="JPEG")}} for im in images]
    body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}], "max_tokens": 3}
    encoder = serve.get_deployment_handle("Encoder", app_name="store")
    ingress = serve.get_deployment_handle("Ingress", app_name="store")
    for stream in (False, True):  # the same two images twice: with the cache on, the second time they are hits
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": stream}, timeout=120)
        assert r.status_code == 200, r.text
    where = locations(record_dir)  # one encoder call holds both images: one ref a request
    assert len(where) == 2 and all(w["size"] > 2 * inline_limit() and w["nodes"] >= 1 for w in where), where
    encoded = encoder.stats.remote().result()["images"]
    seen = deserializations(record_dir)
    assert not [s for s in seen if "Ingress" in s], seen  # the ingress only ever held ObjectRefs
    assert seen == ["store:LLM"] * 4  # each embedding deserialized by the LLM, and only there
    stats = ingress.stats.remote().result()
    if cached:  # two encoded, two hits: the second request was sent the first one's ref
        assert encoded == 2 and (stats["cache_hits"], stats["cache_misses"], stats["cache_objects"]) == (2, 2, 1)
    else:
        assert encoded == 4 and "cache_hits" not in stats


def test_qwen3_vls_deepstack_levels_go_through_the_object_store_with_their_image(ray_serve, app_args, tmp_path):
    """Qwen3-VL: an image's embedding carries its DeepStack levels, (1 + 2) x 64 columns here; it is one object in a
    node's store, sent to the LLM by ref and deserialized there only, as every family's."""
    checkpoint = build_qwen3_vl_checkpoint(tmp_path / "qwen3-vl-tiny", seed=2, max_pixels=32 * 32 * 128)
    images = [make_image(320, 256, seed=30 + i) for i in range(2)]  # 10 x 8 merged: 80 tokens x 192, 60 KiB each
    record_dir = str(tmp_path / "record")
    Path(record_dir).mkdir()
    args = {**app_args, "model": str(checkpoint), "encoder": {"cache_gib": 0, "startup_check": False}}
    encoder = Encoder.bind(args, model_factory=functools.partial(TracingEncoder, record_dir=record_dir))
    llm = LLM.options(func_or_class=LocatingLLM).bind(args, record_dir=record_dir)
    serve.run(Ingress.bind(encoder, llm, args), name="store-q3", route_prefix="/store-q3")
    try:
        parts = [{"type": "image_url", "image_url": {"url": data_url(im, fmt="JPEG")}} for im in images]
        body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}], "max_tokens": 3}
        r = httpx.post(f"{ray_serve}/store-q3/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        serve.delete("store-q3")
    (where,) = locations(record_dir)  # one encoder call holds both images
    assert where["size"] > 2 * 80 * 3 * 64 * 4 > inline_limit() and where["nodes"] >= 1, where  # the levels too
    seen = deserializations(record_dir)
    assert seen == ["store-q3:LLM"] * 2, seen  # each image's tensor, levels and all, deserialized by the LLM only


def _wait(condition, cap_s: float = 60.0) -> None:
    """Wait on state; the cap is generous, there so that a broken app fails instead of hanging."""
    deadline = time.monotonic() + cap_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_error_after_first_token_is_an_event_the_client_raises(instrumented):
    url = instrumented
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    received = []
    with pytest.raises(openai.APIError, match="internal error \\(request chatcmpl-") as e:
        for chunk in client.chat.completions.create(
            model="qwen2-vl-tiny", messages=messages, max_tokens=200, temperature=0, stream=True
        ):
            received.append(chunk)
    # The 200 and the tokens made before the fault went out; the fault came as an event, not as a status.
    assert not isinstance(e.value, openai.APIStatusError)
    assert received and received[0].choices[0].delta.role == "assistant"
    # Before the first token, the same fault is a 500 with the OpenAI body, and the app keeps serving.
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(
            model="qwen2-vl-tiny", max_tokens=5, messages=[{"role": "user", "content": "x " * 120}]
        )
    message = e.value.body["message"]
    request_id = re.fullmatch(r"internal error \(request (chatcmpl-[0-9a-f]{32})\)", message).group(1)
    # The body says nothing of the fault; the ingress's log has the same id with the traceback.
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    deadline = time.monotonic() + 10
    while not any(f"request {request_id} failed" in f.read_text() for f in logs.glob("replica_traced_Ingress_*.log")):
        assert time.monotonic() < deadline, f"{request_id} not in the ingress log"
        time.sleep(0.2)
    text = next(f.read_text() for f in logs.glob("replica_traced_Ingress_*.log") if request_id in f.read_text())
    assert "injected fault" in text.split(request_id, 1)[1]
    ok = client.chat.completions.create(model="qwen2-vl-tiny", messages=messages, max_tokens=3)
    assert ok.usage.completion_tokens == 3


def test_an_error_after_the_first_byte_is_each_apis_error_event(instrumented):
    """The Responses API's `error` event and Anthropic's, as chat's: the 200 and the text made before the fault went
    out, then the event (the LM here fails at position 40)."""
    ask = {"model": "qwen2-vl-tiny", "stream": True, "temperature": 0}
    responses = {**ask, "input": "hi", "max_output_tokens": 200}
    messages = {**ask, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}
    for route, body in (("responses", responses), ("messages", messages)):
        with httpx.stream("POST", f"{instrumented}/v1/{route}", json=body, timeout=120) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        assert len(events) > 3 and events[-1]["type"] == "error", events[-3:]
        error = events[-1] if route == "responses" else events[-1]["error"]
        assert "internal error (request " in error["message"]


def test_llm_refuses_embeddings_that_are_not_refs(base_url):
    """The LLM checks what it receives, so a future ingress that awaited the embeddings would fail loudly."""
    llm = serve.get_deployment_handle("LLM", app_name="vlm")
    request = GenerateRequest(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=1),
        items=[MediaItem("k", (1, 2, 2), 1, 2, pieces=((0, 0),))],
    )
    with pytest.raises(Exception, match="must arrive as ObjectRefs, got Tensor"):
        list(llm.options(stream=True).generate.remote(request, [torch.zeros(1, 64)]))


def test_disconnect_cancels_generation(client, base_url):
    llm = serve.get_deployment_handle("LLM", app_name="vlm")
    before = llm.stats.remote().result()
    leave_mid_stream(client)  # the client goes away after a few chunks
    _wait(lambda: llm.stats.remote().result()["cancelled"] > before["cancelled"])
    stats = llm.stats.remote().result()
    assert stats["cancelled"] == before["cancelled"] + 1 and stats["running"] == 0  # freed, long before its end
    assert stats["finished"] == before["finished"]  # it did not run to its 900 tokens
    body = {"messages": [{"role": "user", "content": "Talk for a long time."}], "max_tokens": 2, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_stop_strings_cut_the_text(client):
    body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 12, "temperature": 0}
    full = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    for stream in (False, True):
        r = client.post("/v1/chat/completions", json={**body, "stop": [stop], "stream": stream})
        if stream:
            chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            text, finish = r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"]
        assert text == full[: full.index(stop)] and finish == "stop"


def test_seeded_sampling_is_reproducible(client):
    body = {
        "messages": [{"role": "user", "content": "Pick words."}],
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": 1234,
        "return_token_ids": True,
    }
    first, second = (client.post("/v1/chat/completions", json=body).json() for _ in range(2))
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
    other = client.post("/v1/chat/completions", json={**body, "seed": 99}).json()
    greedy = client.post("/v1/chat/completions", json={**body, "temperature": 0}).json()
    assert len({tuple(x["choices"][0]["token_ids"]) for x in (first, other, greedy)}) > 1


def test_second_turn_reuses_the_cached_prefix(client):
    llm = serve.get_deployment_handle("LLM", app_name="vlm")
    image = {"type": "image_url", "image_url": {"url": data_url(make_image(120, 90, seed=42))}}
    turn1 = [{"role": "user", "content": [image, {"type": "text", "text": "Describe the picture in detail."}]}]
    first = client.post("/v1/chat/completions", json={"messages": turn1, "max_tokens": 8, "temperature": 0}).json()
    turn2 = turn1 + [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And the colours?"},
    ]
    before = llm.stats.remote().result()["prefix_hits"]
    second = client.post(
        "/v1/chat/completions", json={"messages": turn2, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    ).json()
    hits = llm.stats.remote().result()["prefix_hits"] - before
    assert hits >= first["usage"]["prompt_tokens"] // 16  # at least the whole first prompt, image included
    # A different image in the same place: only the text blocks before it match (exactness of reused blocks is
    # checked against transformers in tests/llm/test_prefix_cache.py).
    other = {"type": "image_url", "image_url": {"url": data_url(make_image(120, 90, seed=43))}}
    swapped = [{**turn2[0], "content": [other, turn2[0]["content"][1]]}, *turn2[1:]]
    before = llm.stats.remote().result()["prefix_hits"]
    client.post("/v1/chat/completions", json={"messages": swapped, "max_tokens": 2, "temperature": 0})
    assert llm.stats.remote().result()["prefix_hits"] - before <= first["usage"]["prompt_tokens"] // 16 // 2
    assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]
