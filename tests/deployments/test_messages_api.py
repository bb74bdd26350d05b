"""POST /v1/messages (Anthropic's Messages API) through the deployed app with the `anthropic` SDK, unchanged: text, an
image (base64 source), streamed, a tool loop (tool_use, then tool_result); greedy text equal to chat's for the same
conversation (one request model inside); errors in Anthropic's shape; `x-api-key` taken like the bearer key."""

from __future__ import annotations

import base64
import io
import json

import anthropic
import httpx
import pytest

from demo.inputs import data_url, make_image, make_video, video_url
from tests.helpers import DEMO_KEY

pytestmark = pytest.mark.e2e

PNG = make_image(120, 80, seed=1)
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "maximum": 7}},
        "required": ["city", "days"],
    },
}


def _client(base_url: str, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=str(base_url).rstrip("/"), api_key="unused", max_retries=0, timeout=120, **kw)


def _png_b64() -> str:
    buf = io.BytesIO()
    PNG.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _chat_text(base_url: str, messages: list, max_tokens: int) -> str:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_text_and_an_image_are_chats(base_url):
    client = _client(base_url)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png_b64()}}
    out = client.messages.create(
        model="qwen2-vl-tiny", max_tokens=10, extra_body={"temperature": 0}, system="Be brief.",
        messages=[{"role": "user", "content": [image, {"type": "text", "text": "What is in it?"}]}],
    )  # fmt: skip
    assert out.type == "message" and out.role == "assistant" and out.stop_reason in ("end_turn", "max_tokens")
    parts = [{"type": "image_url", "image_url": {"url": data_url(PNG)}}, {"type": "text", "text": "What is in it?"}]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    assert out.content[0].text == _chat_text(base_url, chat, 10)
    assert out.usage.input_tokens > 20 and out.usage.output_tokens <= 10


def test_max_tokens_is_the_stop_reason_when_cut(base_url):
    out = _client(base_url).messages.create(
        model="qwen2-vl-tiny", max_tokens=3, messages=[{"role": "user", "content": "Talk for a long time."}]
    )
    assert out.stop_reason == "max_tokens" and out.usage.output_tokens == 3


def test_the_stream_is_the_unstreamed_answer(base_url):
    client = _client(base_url)
    ask = {"model": "qwen2-vl-tiny", "max_tokens": 12, "extra_body": {"temperature": 0},
           "messages": [{"role": "user", "content": "Tell me about red circles."}]}  # fmt: skip
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason


def test_a_tool_loop(tools_app):
    client, _ = tools_app
    claude = _client(client.base_url)
    ask = {"model": "qwen2-vl-tiny", "max_tokens": 120, "extra_body": {"temperature": 0}, "tools": [WEATHER]}
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = claude.messages.create(**ask, messages=[question], tool_choice={"type": "any"})
    uses = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert set(uses[0].input) == {"city", "days"}
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "sunny"} for u in uses]
    history = [question, {"role": "assistant", "content": [u.model_dump() for u in uses]},
               {"role": "user", "content": results}]  # fmt: skip
    second = claude.messages.create(**ask, messages=history, tool_choice={"type": "none"})
    assert second.stop_reason in ("end_turn", "max_tokens") and second.content[0].type == "text"
    with claude.messages.stream(**ask, messages=[question], tool_choice={"type": "tool", "name": "get_weather"}) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["tool_use"] and set(final.content[0].input) == {"city", "days"}


def test_bodies_and_events_are_anthropics_documented_shapes(base_url):
    """Validated by the SDK's own types (generated from Anthropic's API reference), strictly."""
    from anthropic.types import Message, RawMessageStreamEvent
    from pydantic import TypeAdapter

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png_b64()}}
    body = {"model": "qwen2-vl-tiny", "max_tokens": 6,
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": "Hi"}]}]}  # fmt: skip
    r = httpx.post(f"{base_url}/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    Message.model_validate(r.json(), strict=True)
    with httpx.stream("POST", f"{base_url}/v1/messages", json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    adapter = TypeAdapter(RawMessageStreamEvent)
    assert [adapter.validate_python(e, strict=True).type for e in events][-1] == "message_stop"


def test_the_chat_rules_hold_a_bad_image_and_a_forbidden_url(base_url):
    """The same 4xx as chat for an image that does not decode and for a URL the server may not fetch (the app
    allows 127.0.0.1 only): each check is chat's own, and names the field as the client sent it."""
    bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}}
    private = {"type": "image", "source": {"type": "url", "url": "http://10.0.0.1/cat.png"}}
    for image in (bad, private):
        content = [{"type": "text", "text": "what is it?"}, image]
        body = {"model": "qwen2-vl-tiny", "max_tokens": 4, "system": "Be brief.",
                "messages": [{"role": "user", "content": content}]}  # fmt: skip
        r = httpx.post(f"{base_url}/v1/messages", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert r.json()["error"]["message"].startswith("messages[0].content[1].source: "), r.text
        parts = [{"type": "input_text", "text": "what is it?"}, {"type": "input_image", "image_url": _image_url(image)}]
        body = {"instructions": "Be brief.", "input": [{"role": "user", "content": parts}]}
        r = httpx.post(f"{base_url}/v1/responses", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert r.json()["error"]["param"] == "input[0].content[1].image_url", r.text
        assert r.json()["error"]["message"].startswith("input[0].content[1].image_url: "), r.text


def _image_url(image: dict) -> str:
    source = image["source"]
    return source["url"] if source["type"] == "url" else f"data:{source['media_type']};base64,{source['data']}"


def test_errors_are_anthropics_shape(base_url):
    r = httpx.post(f"{base_url}/v1/messages", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        thinking = {"type": "enabled", "budget_tokens": 1024}
        _client(base_url).messages.create(
            model="qwen2-vl-tiny", max_tokens=5, thinking=thinking, messages=[{"role": "user", "content": "hi"}]
        )


def test_x_api_key_is_taken_like_the_bearer_key(demo_app):
    """The demo app has an API key. Anthropic's API takes it as x-api-key (curl and older clients send that); the
    SDK (2.10) sends it as a bearer token: both are taken."""
    url = str(demo_app.base_url).rstrip("/")
    ask = {"model": "qwen2-vl-shapes", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{url}/v1/messages", json=ask, headers={"x-api-key": DEMO_KEY}, timeout=60)
    assert r.status_code == 200 and r.json()["type"] == "message", r.text
    r = httpx.post(f"{url}/v1/messages", json=ask, headers={"x-api-key": "wrong"}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{url}/v1/messages", json=ask, timeout=60)  # no key
    assert r.status_code == 401 and json.loads(r.text)["error"]["type"] == "authentication_error"
    out = anthropic.Anthropic(base_url=url, api_key=DEMO_KEY, max_retries=0, timeout=120).messages.create(**ask)
    assert out.content
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0, timeout=120).messages.create(**ask)


def test_one_conversation_through_the_three_routes_gives_the_same_answer(base_url):
    """One request model inside: chat, responses and messages run the same pipeline, so the same greedy answer and
    the same token counts, for a system prompt, an image and text."""
    image, question = data_url(PNG), "What is in the picture?"
    png = {"type": "base64", "media_type": "image/png", "data": _png_b64()}
    chat_parts = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": question}]
    system = {"role": "system", "content": "Be brief."}
    chat = {"max_tokens": 12, "temperature": 0, "messages": [system, {"role": "user", "content": chat_parts}]}
    response_parts = [{"type": "input_image", "image_url": image}, {"type": "input_text", "text": question}]
    response = {"max_output_tokens": 12, "temperature": 0, "instructions": "Be brief.",
                "input": [{"role": "user", "content": response_parts}]}  # fmt: skip
    message_blocks = [{"type": "image", "source": png}, {"type": "text", "text": question}]
    message = {"max_tokens": 12, "temperature": 0, "system": "Be brief.",
               "messages": [{"role": "user", "content": message_blocks}]}  # fmt: skip
    chat = httpx.post(f"{base_url}/v1/chat/completions", json=chat, timeout=120).json()
    response = httpx.post(f"{base_url}/v1/responses", json=response, timeout=120).json()
    message = httpx.post(f"{base_url}/v1/messages", json=message, timeout=120).json()
    text = chat["choices"][0]["message"]["content"]
    assert response["output"][0]["content"][0]["text"] == text == message["content"][0]["text"]
    counts = (chat["usage"]["prompt_tokens"], chat["usage"]["completion_tokens"])
    assert (response["usage"]["input_tokens"], response["usage"]["output_tokens"]) == counts
    assert (message["usage"]["input_tokens"], message["usage"]["output_tokens"]) == counts


def test_a_video_through_the_responses_api_is_chats(base_url):
    """Video, which OpenAI's Responses API does not take, as an `input_video` part: chat's video, the same answer."""
    url = video_url(make_video(1.0, fps=4, seed=2))
    chat = httpx.post(f"{base_url}/v1/chat/completions", timeout=120, json={"max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                  {"type": "text", "text": "What happens?"}]}]}).json()  # fmt: skip
    out = httpx.post(f"{base_url}/v1/responses", timeout=120, json={"max_output_tokens": 8, "temperature": 0,
        "input": [{"role": "user", "content": [{"type": "input_video", "video_url": url},
                                               {"type": "input_text", "text": "What happens?"}]}]}).json()  # fmt: skip
    assert out["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert out["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"] > 30
