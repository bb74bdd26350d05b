"""What the ingress writes, without Ray: completions, every stream chunk, and error bodies of every status
validate against OpenAI's published schemas (tests/api_schema), with our extensions as extra fields."""

from __future__ import annotations

import asyncio
import functools
import json
import re
from pathlib import Path

import pytest
from ray.serve.exceptions import BackPressureError

from deployments.ingress.grounding import GroundingTokens, pixel_boxes
from deployments.ingress.http import error_response
from deployments.ingress.prompt import load_tokenizer
from deployments.ingress.responses import completion, sse_stream, with_deadline
from schemas import InvalidRequest, Overloaded, TokenChunk, TokenLogprob
from schemas.openai import ChatCompletionRequest
from tests.api_schema import assert_valid

DEMO = Path(__file__).parents[3] / "demo" / "qwen2-vl-shapes"
HEAD = {"id": "chatcmpl-0", "created": 1_700_000_000, "model": "qwen2-vl-shapes", "system_fingerprint": "fp_0123456789"}
ANSWER = "It is <|object_ref_start|>the red circle<|object_ref_end|><|box_start|>(100,250),(300,500)<|box_end|>"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO)


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def _deltas(tokenizer, logprobs: bool) -> list[tuple[int, TokenChunk]]:
    """Choice 0 grounds (a box), choice 1 runs out of tokens; each token its own delta, as the engine sends them."""
    out = []
    for i, (text, finish) in enumerate([(ANSWER, "stop"), ("a red circle", "length")]):
        ids = tokenizer.encode(text, add_special_tokens=False)
        for k, t in enumerate(ids):
            lp = [TokenLogprob(-0.5, [(t, -0.5), (t + 1, -1.5)])] if logprobs else None
            out.append(
                (
                    i,
                    TokenChunk(
                        [t],
                        finish if k == len(ids) - 1 else None,
                        lp,
                        num_cached_tokens=2 if k == 0 else None,
                        text=tokenizer.decode([t]),
                    ),
                )
            )
    return out


async def _events(deltas):
    for item in deltas:
        yield item


def _boxes(tokenizer):
    return functools.partial(
        pixel_boxes,
        marks=GroundingTokens.of(tokenizer),
        tokenizer=tokenizer,
        image_sizes=[(640, 480)],
        image_numbers=[0],
    )


def _sse(req, events, tokenizer) -> list[dict]:
    async def collect():
        return [
            e
            async for e in sse_stream(
                req, HEAD, [1, 2, 3], events, tokenizer, "chatcmpl-0", lambda choices: None, _boxes(tokenizer)
            )
        ]

    lines = asyncio.run(collect())
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.mark.parametrize(
    "fields",
    [{}, {"logprobs": True, "top_logprobs": 2, "return_token_ids": True}],
    ids=["plain", "logprobs_and_token_ids"],
)
def test_a_completion_of_n_choices_validates(tokenizer, fields):
    req = _request(n=2, **fields)
    events = _events(_deltas(tokenizer, logprobs=req.logprobs))
    body, _ = asyncio.run(completion(req, HEAD, [1, 2, 3], events, tokenizer, _boxes(tokenizer)))
    out = json.loads(body.model_dump_json())
    assert_valid("CreateChatCompletionResponse", out)
    assert out["system_fingerprint"] == HEAD["system_fingerprint"]
    first, second = out["choices"]
    assert first["message"]["boxes"][0]["label"] == "the red circle" and "boxes" not in second["message"]
    assert second["finish_reason"] == "length"
    if req.logprobs:
        assert first["logprobs"]["refusal"] is None and first["logprobs"]["content"][0]["top_logprobs"]
        assert out["prompt_token_ids"] == [1, 2, 3] and first["token_ids"]
    else:
        assert first["logprobs"] is None


@pytest.mark.parametrize("usage", [False, True], ids=["without_usage", "with_usage"])
def test_every_stream_chunk_validates(tokenizer, usage):
    req = _request(
        n=2, stream=True, logprobs=True, top_logprobs=2, return_token_ids=True, stream_options={"include_usage": usage}
    )
    chunks = _sse(req, _events(_deltas(tokenizer, logprobs=True)), tokenizer)
    for chunk in chunks:
        assert_valid("CreateChatCompletionStreamResponse", chunk)
        assert chunk["system_fingerprint"] == HEAD["system_fingerprint"]  # every chunk, the fast content ones too
    finishes = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f["index"] for f in finishes] == [0, 1] and finishes[0]["delta"]["boxes"]
    assert any(c["choices"][0].get("logprobs") for c in chunks if c["choices"])
    assert (chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 3) is usage


def test_an_error_after_the_first_token_is_an_error_event_that_validates(tokenizer):
    """The deadline passes mid-stream: the 200 is already out, so the 408 goes as an event."""

    async def hangs():
        yield 0, TokenChunk([40], text="It")
        await asyncio.Event().wait()  # nothing more comes

    async def collect():
        loop = asyncio.get_running_loop()
        events = with_deadline(hangs(), loop.time() + 0.2, 0.2)
        return [
            e
            async for e in sse_stream(
                _request(stream=True), HEAD, [1], events, tokenizer, "chatcmpl-0", lambda choices: None
            )
        ]

    *chunks, error, done = asyncio.run(collect())
    assert done == "data: [DONE]\n\n"
    for chunk in chunks:
        assert_valid("CreateChatCompletionStreamResponse", json.loads(chunk.removeprefix("data: ")))
    error = json.loads(error.removeprefix("data: "))
    assert_valid("ErrorResponse", error)
    assert error["error"]["code"] == "request_timeout"


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (InvalidRequest("messages: field required", param="messages", code="missing"), 400),
        (InvalidRequest("invalid API key", status=401, code="invalid_api_key"), 401),
        (InvalidRequest("no route /v2", status=404, code="not_found"), 404),
        (InvalidRequest("/v1/models takes GET, not POST", status=405), 405),
        (InvalidRequest("request did not finish within its deadline", status=408, code="request_timeout"), 408),
        (InvalidRequest("request body is over the limit", status=413), 413),
        (InvalidRequest("image host example.com does not resolve", code="image_url_fetch_failed", status=422), 422),
        (InvalidRequest("could not fetch the image from example.com", code="image_url_fetch_failed", status=502), 502),
        (InvalidRequest("fetching the image took over 1 s", code="image_url_timeout", status=504), 504),
        (InvalidRequest("client closed the request", status=499, code="client_closed"), 499),
        (Overloaded("the engine queue is full", retry_after_s=2), 503),
        (BackPressureError(num_queued_requests=9, max_queued_requests=8), 503),
        (RuntimeError("a bug of ours"), 500),
    ],
)
def test_every_error_status_has_a_body_that_validates(error, status):
    response = error_response(error, "chatcmpl-0")
    assert response.status_code == status
    assert_valid("ErrorResponse", json.loads(response.body))


def test_the_system_fingerprint_follows_what_can_change_the_tokens(checkpoint):
    from deployments.ingress.responses import system_fingerprint
    from schemas import AppArgs

    def fp(**args) -> str:
        return system_fingerprint(AppArgs(model=str(checkpoint), **args), "model-id")

    base = fp()
    assert re.fullmatch(r"fp_[0-9a-f]{10}", base) and fp() == base
    assert fp(limits={"max_n": 2}, auth={"api_keys": ["k"]}, served_model_name="x") == base  # no effect on tokens
    assert len({base, fp(dtype="bfloat16"), fp(llm={"enable_prefix_caching": False})}) == 3
    assert system_fingerprint(AppArgs(model=str(checkpoint)), "another-checkpoint") != base
