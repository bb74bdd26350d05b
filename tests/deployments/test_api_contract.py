"""The deployed app against OpenAI's published schemas (tests/api_schema): every response shape it produces,
streamed or not, the model list and its error statuses validate; our extensions ride along as extra fields.
(The 408, 503 and mid-stream error event need a slow model: test_deadlines validates them, test_responses
every status without Ray.)"""

from __future__ import annotations

import json
import random

import pytest

from demo.inputs import data_url
from demo.local import LIMITS
from demo.scenes import make_item
from tests.api_schema import assert_valid, errors

pytestmark = pytest.mark.e2e
GROUNDING, COLOUR = make_item(random.Random(1), "grounding"), make_item(random.Random(2), "colour")


def _messages(item: dict) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                *({"type": "image_url", "image_url": {"url": data_url(im)}} for im in item["images"]),
                {"type": "text", "text": item["question"]},
            ],
        }
    ]


@pytest.fixture(scope="module")
def app(demo_app):
    """The session's demo app (tests/conftest.py): the trained demo model, whose grounding answers carry boxes; API
    keys on, the client sends its key. Colocated: the bodies are the ingress's either way."""
    return demo_app


def _chat(item: dict, **fields) -> dict:
    return {"messages": _messages(item), "max_tokens": 8, "temperature": 0, **fields}


def _boxes(choice: dict) -> list:
    return choice["message"].get("boxes") or []


# (request, a check that the case really produced its shape)
COMPLETIONS = {
    "plain": (_chat(COLOUR), lambda out: out["choices"][0]["logprobs"] is None),
    "n_and_seed": (_chat(COLOUR, n=3, temperature=1.0, seed=11), lambda out: len(out["choices"]) == 3),
    "logprobs": (
        _chat(COLOUR, logprobs=True, top_logprobs=3),
        lambda out: len(out["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3,
    ),
    "stop_string": (
        _chat(GROUNDING, max_tokens=48, stop=["("]),
        lambda out: out["choices"][0]["finish_reason"] == "stop" and not _boxes(out["choices"][0]),
    ),
    "length": (_chat(COLOUR, max_tokens=1), lambda out: out["choices"][0]["finish_reason"] == "length"),
    "token_ids": (
        _chat(COLOUR, return_token_ids=True),
        lambda out: out["prompt_token_ids"] and out["choices"][0]["token_ids"],
    ),
    "grounding_boxes": (_chat(GROUNDING, max_tokens=48), lambda out: _boxes(out["choices"][0])),
}


@pytest.mark.parametrize("case", COMPLETIONS)
def test_completions_validate(app, case):
    body, produced = COMPLETIONS[case]
    r = app.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert_valid("CreateChatCompletionResponse", out)
    assert produced(out), out["choices"]
    assert out["system_fingerprint"].startswith("fp_") and len(r.headers.get_list("x-request-id")) == 1


def _finish(chunks: list[dict]) -> list[dict]:
    return [c for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]


STREAMS = {
    "plain": (_chat(COLOUR), lambda chunks: "usage" not in chunks[-1] and len(_finish(chunks)) == 1),
    "with_usage": (
        _chat(COLOUR, stream_options={"include_usage": True}),
        lambda chunks: chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0,
    ),
    "n_logprobs_usage": (
        _chat(
            COLOUR, n=2, temperature=1.0, seed=5, logprobs=True, top_logprobs=2, stream_options={"include_usage": True}
        ),
        lambda chunks: (
            len(_finish(chunks)) == 2 and any(c.get("logprobs") for chunk in chunks for c in chunk["choices"])
        ),
    ),
    "token_ids": (_chat(COLOUR, return_token_ids=True), lambda chunks: chunks[0]["prompt_token_ids"]),
    "grounding_boxes": (_chat(GROUNDING, max_tokens=48), lambda chunks: _finish(chunks)[0]["delta"].get("boxes")),
}


@pytest.mark.parametrize("case", STREAMS)
def test_every_stream_chunk_validates(app, case):
    body, produced = STREAMS[case]
    with app.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        assert_valid("CreateChatCompletionStreamResponse", chunk)
    assert produced(chunks), chunks
    assert len({c["system_fingerprint"] for c in chunks}) == 1 and chunks[0]["system_fingerprint"].startswith("fp_")


# Text completions: (request, a check that the case really produced its shape). The demo model ends a plain prompt
# at once (it knows chat prompts only): ignore_eos makes it write.
TEXT = {"prompt": "The colour of the circle is", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
TEXT_COMPLETIONS = {
    "plain": (TEXT, lambda out: out["choices"][0]["text"] and out["choices"][0]["logprobs"] is None),
    "prompts_n_logprobs": (
        {**TEXT, "prompt": [[7, 8, 9], [10]], "n": 2, "temperature": 1.0, "seed": 4, "logprobs": 2},
        lambda out: len(out["choices"]) == 4 and len(out["choices"][3]["logprobs"]["top_logprobs"][0]) >= 2,
    ),
    "echo_and_token_ids": (
        {**TEXT, "echo": True, "return_token_ids": True},
        lambda out: out["choices"][0]["text"].startswith(TEXT["prompt"]) and out["choices"][0]["prompt_token_ids"],
    ),
    "length": ({**TEXT, "max_tokens": 1}, lambda out: out["choices"][0]["finish_reason"] == "length"),
}


@pytest.mark.parametrize("case", TEXT_COMPLETIONS)
def test_text_completions_validate(app, case):
    body, produced = TEXT_COMPLETIONS[case]
    r = app.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert_valid("CreateCompletionResponse", r.json())
    assert produced(r.json()), r.json()["choices"]


@pytest.mark.parametrize("case", ["plain", "prompts_n_logprobs", "echo_and_token_ids"])
def test_every_text_completion_chunk_validates(app, case):
    """Each chunk is a CreateCompletionResponse (OpenAI streams that object), except that a choice's chunks before
    its last have finish_reason null, as OpenAI's own stream sends them and its schema does not list."""
    body = {**TEXT_COMPLETIONS[case][0], "stream": True, "stream_options": {"include_usage": True}}
    with app.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        problems = errors("CreateCompletionResponse", chunk)
        unfinished = [f"$.choices[{i}].finish_reason" for i, c in enumerate(chunk["choices"]) if not c["finish_reason"]]
        assert [p for p in problems if p.split(":")[0] not in unfinished] == [], chunk
    finished = [c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
    assert sorted(finished) == list(range(len(finished))) and chunks[-1]["usage"]["completion_tokens"] > 0


def test_the_model_list_validates(app):
    r = app.get("/v1/models")
    assert r.status_code == 200, r.text
    assert_valid("ListModelsResponse", r.json())
    assert r.json()["data"][0]["id"] == "qwen2-vl-shapes"
    one = app.get("/v1/models/qwen2-vl-shapes")
    assert one.status_code == 200 and one.json() == {**r.json()["data"][0], "created": one.json()["created"]}
    assert_valid("Model", one.json())
    for path in ("/health", "/v1/models"):  # through Serve's proxy too, which leaves out a HEAD's body
        head = app.head(path)
        assert head.status_code == 200 and head.content == b"", path


HI = [{"role": "user", "content": "hi"}]
ERRORS = {  # (method, path, keyword arguments of httpx, status)
    "bad_field": ("POST", "/v1/chat/completions", {"json": {"messages": HI, "temperature": "hot"}}, 400),
    "not_json": ("POST", "/v1/chat/completions", {"content": b"{"}, 400),
    "bad_image": (
        "POST",
        "/v1/chat/completions",
        {
            "json": {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
                    }
                ]
            }
        },
        400,
    ),
    "stream_before_first_token": (
        "POST",
        "/v1/chat/completions",
        {"json": {"messages": HI, "stream": True, "max_tokens": 5000}},
        400,
    ),
    "no_key": ("POST", "/v1/chat/completions", {"json": {"messages": HI}, "headers": {"Authorization": ""}}, 401),
    "wrong_key": ("GET", "/v1/models", {"headers": {"Authorization": "Bearer sk-wrong"}}, 401),
    "no_route": ("POST", "/v2/chat", {"json": {}}, 404),
    "unknown_model": ("POST", "/v1/chat/completions", {"json": {"messages": HI, "model": "gpt-4o"}}, 404),
    "unknown_model_card": ("GET", "/v1/models/gpt-4o", {}, 404),
    "null_where_a_value_is_required": (
        "POST",
        "/v1/chat/completions",
        {"json": {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}},
        400,
    ),
    "wrong_method": ("GET", "/v1/chat/completions", {}, 405),
    "unsupported_parameter": ("POST", "/v1/completions", {"json": {"prompt": "hi", "suffix": "!"}}, 400),
    "bad_tokenize": ("POST", "/tokenize", {"json": {"prompt": "hi", "messages": HI}}, 400),
    "body_too_large": (
        "POST",
        "/v1/chat/completions",
        {"json": {"messages": [{"role": "user", "content": "x" * LIMITS["max_request_bytes"]}]}},
        413,
    ),
}


@pytest.mark.parametrize("case", ERRORS)
def test_every_error_status_validates(app, case):
    method, path, kwargs, status = ERRORS[case]
    r = app.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json" and r.headers["x-request-id"]
    assert_valid("ErrorResponse", r.json())
    assert (r.headers.get("x-should-retry") == "false") is (status < 500)  # the same request gets the same 4xx
