"""POST /v1/responses (OpenAI's Responses API) through the deployed app with the `openai` client, unchanged: a string,
an image, streamed, `text.format` with a pydantic model (`responses.parse`), a function-tool loop with
`function_call_output`, cut by `max_output_tokens`; greedy tokens equal chat's for the same conversation (one request
model inside: the same pipeline); every body and event validates against OpenAI's published schemas; what is not
kept here (`previous_response_id`, `store: true`) is a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from demo.inputs import data_url, make_image
from tests.api_schema import assert_valid

pytestmark = pytest.mark.e2e

IMAGE = data_url(make_image(120, 80, seed=1))
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "maximum": 7}},
        "required": ["city", "days"],
    },
}


@pytest.fixture(scope="module")
def oai(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tools_oai(tools_app):  # the checkpoint whose template renders tools (tests/conftest.py)
    client, _ = tools_app
    return openai.OpenAI(base_url=f"{client.base_url}v1", api_key="unused", max_retries=0, timeout=120)


def _chat_text(base_url: str, messages: list, max_tokens: int) -> str:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_a_string_input_is_chats_user_message(oai, base_url):
    out = oai.responses.create(model="qwen2-vl-tiny", input="Tell me about red circles.", max_output_tokens=8,
                               temperature=0, instructions="Be brief.")  # fmt: skip
    assert out.object == "response" and out.id.startswith("resp_") and out.status in ("completed", "incomplete")
    assert [item.type for item in out.output] == ["message"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about red circles."}]
    assert out.output_text == _chat_text(base_url, messages, 8)
    assert out.usage.output_tokens <= 8 and out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens


def test_an_image_is_chats_image(oai, base_url):
    content = [{"type": "input_text", "text": "What is in the picture?"}, {"type": "input_image", "image_url": IMAGE}]
    out = oai.responses.create(
        model="qwen2-vl-tiny", input=[{"role": "user", "content": content}], max_output_tokens=10, temperature=0
    )
    chat = [{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"},
                                         {"type": "image_url", "image_url": {"url": IMAGE}}]}]  # fmt: skip
    assert out.output_text == _chat_text(base_url, chat, 10)
    assert out.usage.input_tokens > 20  # the image's placeholder tokens are in the prompt


def test_max_output_tokens_makes_it_incomplete(oai):
    out = oai.responses.create(model="qwen2-vl-tiny", input="Talk for a long time.", max_output_tokens=3)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3


def test_the_stream_is_the_unstreamed_answer(oai):
    content = [{"type": "input_image", "image_url": IMAGE}, {"type": "input_text", "text": "Describe it."}]
    ask = {"model": "qwen2-vl-tiny", "input": [{"role": "user", "content": content}], "max_output_tokens": 12,
           "temperature": 0}  # fmt: skip
    whole = oai.responses.create(**ask)
    events = list(oai.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text


class Weather(BaseModel):
    city: str = Field(max_length=10)
    days: int = Field(ge=1, le=7)


def test_text_format_parses_into_a_pydantic_model(oai):
    out = oai.responses.parse(model="qwen2-vl-tiny", input="The weather?", text_format=Weather, max_output_tokens=60,
                              temperature=1.0, extra_body={"seed": 3})  # fmt: skip
    assert isinstance(out.output_parsed, Weather)


def test_a_function_tool_loop(tools_oai):
    """A required call, then its output sent back as a function_call_output item: the model answers in text."""
    ask = {"model": "qwen2-vl-tiny", "tools": [WEATHER], "temperature": 0, "max_output_tokens": 120}
    first = tools_oai.responses.create(**ask, input="What is the weather in Paris?", tool_choice="required")
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert set(json.loads(calls[0].arguments)) == {"city", "days"}
    history = [{"role": "user", "content": "What is the weather in Paris?"}, *[c.model_dump() for c in calls]]
    history += [{"type": "function_call_output", "call_id": c.call_id, "output": '{"sky": "clear"}'} for c in calls]
    second = tools_oai.responses.create(**ask, input=history, tool_choice="none")
    assert [item.type for item in second.output] == ["message"] and second.output_text


def test_a_streamed_function_call(tools_oai):
    named = {"type": "function", "name": "get_weather"}
    ask = {"model": "qwen2-vl-tiny", "tools": [WEATHER], "temperature": 0, "max_output_tokens": 120}
    events = list(tools_oai.responses.create(**ask, input="Weather in Rome?", tool_choice=named, stream=True))
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(args) == 1 and set(json.loads(args[0].arguments)) == {"city", "days"}
    assert events[-1].type == "response.completed"
    assert [item.type for item in events[-1].response.output] == ["function_call"]


def test_every_body_and_event_validates(base_url):
    content = [{"type": "input_text", "text": "Hi"}, {"type": "input_image", "image_url": IMAGE}]
    body = {"model": "qwen2-vl-tiny", "input": [{"role": "user", "content": content}], "max_output_tokens": 4}
    r = httpx.post(f"{base_url}/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert_valid("Response", r.json())
    names = {
        "response.created": "ResponseCreatedEvent", "response.in_progress": "ResponseInProgressEvent",
        "response.completed": "ResponseCompletedEvent", "response.incomplete": "ResponseIncompleteEvent",
        "response.output_item.added": "ResponseOutputItemAddedEvent",
        "response.output_item.done": "ResponseOutputItemDoneEvent",
        "response.content_part.added": "ResponseContentPartAddedEvent",
        "response.content_part.done": "ResponseContentPartDoneEvent",
        "response.output_text.delta": "ResponseTextDeltaEvent", "response.output_text.done": "ResponseTextDoneEvent",
    }  # fmt: skip
    with httpx.stream("POST", f"{base_url}/v1/responses", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert events and {e["type"] for e in events} <= set(names)
    for event in events:
        assert_valid(names[event["type"]], event)


def test_a_response_with_function_calls_validates(tools_app):
    client, _ = tools_app
    body = {"model": "qwen2-vl-tiny", "input": "Weather in Oslo?", "tools": [WEATHER], "tool_choice": "required",
            "temperature": 0, "max_output_tokens": 120}  # fmt: skip
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert [item["type"] for item in r.json()["output"]] == ["function_call"]
    assert_valid("Response", r.json())
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        events = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines() if line.startswith("data: ")]
    names = {
        "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
        "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
        "response.output_item.added": "ResponseOutputItemAddedEvent",
        "response.output_item.done": "ResponseOutputItemDoneEvent",
        "response.completed": "ResponseCompletedEvent",
    }
    for event in events:
        if event["type"] in names:
            assert_valid(names[event["type"]], event)
    assert "response.function_call_arguments.done" in {e["type"] for e in events}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "input_file", "file_id": "f"}]}, "input[0].type"),
    ],
)
def test_what_is_not_kept_or_not_supported_is_a_400_naming_it(base_url, extra, param):
    body = {"model": "qwen2-vl-tiny", "input": "hi", **extra}
    r = httpx.post(f"{base_url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
