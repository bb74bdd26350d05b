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

from deployments.ingress import Ingress
from encoders.server import Encoder
from llm.server import LLM
from schemas import GenerateRequest, SamplingParams
from tests.deployments.instruments import FaultyLM, TracingEncoder, deserializations
from tests.helpers import data_url, leave_mid_stream, make_image

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def instrumented(ray_serve, app_args, tmp_path_factory):
    """A second app at /traced: its encoder's outputs record who unpickles them, its LM fails at position 40."""
    record_dir = str(tmp_path_factory.mktemp("unpickled"))
    encoder = Encoder.bind(app_args, model_factory=functools.partial(TracingEncoder, record_dir=record_dir))
    serve.run(Ingress.bind(encoder, LLM.bind(app_args, model_factory=FaultyLM.load), app_args),
              name="traced", route_prefix="/traced")
    yield f"{ray_serve}/traced", record_dir
    serve.delete("traced")


def test_ingress_never_deserializes_an_embedding(instrumented):
    url, record_dir = instrumented
    images = [{"type": "image_url", "image_url": {"url": data_url(make_image(80 + 20 * i, 60, seed=i))}}
              for i in range(3)]
    body = {"messages": [{"role": "user", "content": [*images, {"type": "text", "text": "hi"}]}], "max_tokens": 3}
    for stream in (False, True):
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 200, r.text
    seen = deserializations(record_dir)
    # The instrument works: the LLM deserialized each of the 6 embeddings exactly once...
    assert seen.count("traced:LLM") == 6
    # ...and nobody else did: the ingress only ever held ObjectRefs.
    assert set(seen) == {"traced:LLM"}


def test_error_after_first_token_is_an_event_the_client_raises(instrumented):
    url, _ = instrumented
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    received = []
    with pytest.raises(openai.APIError, match="internal error \\(request chatcmpl-") as e:
        for chunk in client.chat.completions.create(model="qwen2-vl-tiny", messages=messages, max_tokens=200,
                                                    temperature=0, stream=True):
            received.append(chunk)
    # The 200 and the tokens made before the fault went out; the fault came as an event, not as a status.
    assert not isinstance(e.value, openai.APIStatusError)
    assert received and received[0].choices[0].delta.role == "assistant"
    # Before the first token, the same fault is a 500 with the OpenAI body, and the app keeps serving.
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="qwen2-vl-tiny", max_tokens=5,
                                       messages=[{"role": "user", "content": "x " * 120}])
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


def test_llm_refuses_embeddings_that_are_not_refs(base_url):
    """The LLM checks what it receives, so a future ingress that awaited the embeddings would fail loudly."""
    llm = serve.get_deployment_handle("LLM", app_name="vlm")
    request = GenerateRequest("r", [1, 2, 3], [(1, 2, 2)], [torch.zeros(1, 64)], SamplingParams(max_tokens=1))
    with pytest.raises(Exception, match="must arrive as ObjectRefs, got Tensor"):
        list(llm.options(stream=True).generate.remote(request))


def test_disconnect_cancels_generation(client, base_url):
    llm = serve.get_deployment_handle("LLM", app_name="vlm")
    before = llm.stats.remote().result()
    leave_mid_stream(client)  # the client goes away after a few chunks
    deadline = time.monotonic() + 1.0
    while (stats := llm.stats.remote().result())["cancelled"] == before["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats["cancelled"] == before["cancelled"] + 1 and stats["running"] == 0  # freed within a second
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
    body = {"messages": [{"role": "user", "content": "Pick words."}], "max_tokens": 10, "temperature": 1.0,
            "seed": 1234, "return_token_ids": True}
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
    turn2 = turn1 + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And the colours?"}]
    before = llm.stats.remote().result()["prefix_hits"]
    second = client.post("/v1/chat/completions", json={"messages": turn2, "max_tokens": 8, "temperature": 0,
                                                       "return_token_ids": True}).json()
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
