"""Anthropic's Messages request as the chat request it runs as (schemas/anthropic.py): system, text and image blocks,
tool_use and tool_result as an agent loop's history, tools and tool_choice; and the 400s, each naming its field."""

from __future__ import annotations

import pytest

from deployments.ingress.http import parse
from schemas import InvalidRequest
from schemas.anthropic import MessagesRequest
from schemas.openai import ChatCompletionRequest


def _chat(body: dict) -> dict:
    out = parse(MessagesRequest, {"max_tokens": 16, **body}).chat_form().body
    parse(ChatCompletionRequest, out)  # chat's own validation takes it
    return out


def test_system_text_and_sampling_are_chats():
    out = _chat({"system": "Be brief.", "messages": [{"role": "user", "content": "hi"}], "stop_sequences": ["x"],
                 "temperature": 0.5, "top_k": 5})  # fmt: skip
    assert out["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (out["max_completion_tokens"], out["stop"], out["temperature"], out["top_k"]) == (16, ["x"], 0.5, 5)


def test_images_tool_use_and_tool_results_are_an_agent_loops_history():
    messages = [
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "AAAA"}},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
            {"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "text", "text": "Thanks."}]},
    ]  # fmt: skip
    out = _chat({"messages": messages})["messages"]
    assert out[0]["content"][:2] == [
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
    ]
    assert out[1]["content"] == [{"type": "text", "text": "Let me look."}]
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert out[1]["tool_calls"] == [{"id": "toolu_1", "type": "function", "function": call}]
    assert out[2:] == [{"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
                       {"role": "user", "content": [{"type": "text", "text": "Thanks."}]}]  # fmt: skip


def test_tools_and_tool_choice_are_chats():
    tool = {"name": "f", "description": "F.", "input_schema": {"type": "object", "properties": {}}}
    out = _chat({"messages": [{"role": "user", "content": "hi"}], "tools": [tool],
                 "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})  # fmt: skip
    assert out["tools"] == [{"type": "function", "function": {"name": "f", "parameters": tool["input_schema"],
                                                              "description": "F."}}]  # fmt: skip
    assert (out["tool_choice"], out["parallel_tool_calls"]) == ("required", False)
    named = _chat({"messages": [{"role": "user", "content": "hi"}], "tools": [tool],
                   "tool_choice": {"type": "tool", "name": "f"}})  # fmt: skip
    assert named["tool_choice"] == {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
         "messages[0].content[0].source.type"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
        ({"tool_choice": {"type": "mystery"}}, "tool_choice.type"),
    ],
)  # fmt: skip
def test_what_is_not_taken_is_a_400_naming_it(body, param):
    with pytest.raises(InvalidRequest) as e:
        _chat({"messages": [{"role": "user", "content": "hi"}], **body})
    assert e.value.param == param and e.value.status == 400


def test_max_tokens_is_required():
    with pytest.raises(InvalidRequest, match="max_tokens"):
        parse(MessagesRequest, {"messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize(
    ("chat_param", "param"),
    [
        ("messages[0].content", "system"),
        ("messages[1].content[0].image_url", "messages[0].content[0].source"),
        ("messages[2].tool_calls[0].function.arguments", "messages[1].content[1].input"),
        ("messages[2].content[0].text", "messages[1].content[0].text"),
        ("messages[3].tool_call_id", "messages[2].content[0].tool_use_id"),  # a tool_result: a tool message before
        ("messages[4].content[1].image_url.url", "messages[2].content[2].source"),  # ... its text and image parts
        ("messages[4].content[0]", "messages[2].content[1]"),
        ("max_completion_tokens", "max_tokens"),
        ("stop", "stop_sequences"),
        ("tools[0].function.parameters", "tools[0].input_schema"),
        ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"),
    ],
)
def test_chats_400s_name_the_field_the_client_sent(chat_param, param):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    messages = [
        {"role": "user", "content": [image]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me see."},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "one"},
                                     {"type": "text", "text": "and"}, image]},
    ]  # fmt: skip
    body = {"max_tokens": 16, "system": "Be brief.", "messages": messages, "tools": [{"name": "f", "input_schema": {}}]}
    form = parse(MessagesRequest, body).chat_form()
    parse(ChatCompletionRequest, form.body)
    error = InvalidRequest(f"{chat_param}: the image could not be decoded", param=chat_param)
    form.own(error)
    assert error.param == param and error.message == f"{param}: the image could not be decoded"
