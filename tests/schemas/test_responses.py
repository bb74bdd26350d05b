"""The Responses API's request as the chat request it runs as (schemas/responses.py): instructions, input items and
parts, function calls and their outputs, tools, tool_choice, text.format, truncation; and the 400s, each naming its
field."""

from __future__ import annotations

import pytest

from deployments.ingress.http import parse
from schemas import InvalidRequest
from schemas.openai import ChatCompletionRequest
from schemas.responses import ResponsesRequest


def _chat(body: dict) -> dict:
    out = parse(ResponsesRequest, body).chat_form().body
    parse(ChatCompletionRequest, out)  # chat's own validation takes it
    return out


def test_a_string_and_instructions_are_a_system_and_a_user_message():
    out = _chat({"input": "hi", "instructions": "Be brief.", "max_output_tokens": 5, "temperature": 0})
    assert out["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert out["max_completion_tokens"] == 5 and out["temperature"] == 0 and out["context_overflow"] == "error"


def test_parts_are_renamed_and_calls_and_outputs_are_an_agent_loops_history():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Look"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
    ]  # fmt: skip
    messages = _chat({"input": items})["messages"]
    assert messages[0]["content"] == [
        {"type": "text", "text": "Look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "auto"}},
    ]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["call_1", "call_2"]  # parallel calls: one turn
    assert messages[1]["tool_calls"][1]["function"] == {"name": "g", "arguments": '{"a": 1}'}
    assert messages[2:4] == [{"role": "tool", "tool_call_id": "call_1", "content": "one"},
                             {"role": "tool", "tool_call_id": "call_2", "content": "two"}]  # fmt: skip
    assert messages[4] == {"role": "assistant", "content": [{"type": "text", "text": "Done."}]}


def test_tools_tool_choice_text_format_and_truncation_are_chats():
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}, "strict": True}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    out = _chat({
        "input": "hi", "tools": [tool], "tool_choice": {"type": "function", "name": "f"}, "truncation": "auto",
        "text": {"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}},
    })  # fmt: skip
    assert out["tools"] == [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}]
    assert out["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert out["response_format"] == {"type": "json_schema", "json_schema": {"name": "A", "schema": schema,
                                                                             "strict": True}}  # fmt: skip
    assert out["context_overflow"] == "drop_oldest_turns"
    assert _chat({"input": "hi", "text": {"format": {"type": "json_object"}}})["response_format"] == {
        "type": "json_object"
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
         "input[0].content[0].image_url"),
        ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "mcp"}}, "tool_choice"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format"),
    ],
)  # fmt: skip
def test_what_is_not_supported_is_a_400_naming_it(body, param):
    with pytest.raises(InvalidRequest) as e:
        _chat({"input": "hi", **body})
    assert e.value.param == param and e.value.status == 400


def test_a_video_is_an_input_video_part_as_chats_video_url():
    part = {"type": "input_video", "video_url": "data:video/mp4;base64,AAAA"}
    messages = _chat({"input": [{"role": "user", "content": [part]}]})["messages"]
    assert messages[0]["content"] == [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]


def test_store_false_and_metadata_are_accepted():
    assert _chat({"input": "hi", "store": False, "metadata": {"k": "v"}, "user": "u"})["messages"]


def _own(body: dict, chat_param: str) -> InvalidRequest:
    """The 400 one of chat's checks gives with `chat_param` (worded as they word it), in this request's terms."""
    error = InvalidRequest(f"{chat_param}: the image could not be decoded", param=chat_param, code="bad_image")
    parse(ResponsesRequest, body).chat_form().own(error)
    return error


HISTORY = [
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "one"},
    {"role": "user", "content": [{"type": "input_text", "text": "and"},
                                 {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
]  # fmt: skip


@pytest.mark.parametrize(
    ("chat_param", "param"),
    [
        ("messages[0].content", "instructions"),
        ("messages[3].content[1].image_url", "input[3].content[1].image_url"),  # after a turn of two calls
        ("messages[3].content[1].image_url.url", "input[3].content[1].image_url"),
        ("messages[1].tool_calls[1].function.arguments", "input[1].arguments"),  # the second call, joined to one turn
        ("messages[1].tool_calls[0].id", "input[0].call_id"),
        ("messages[2].tool_call_id", "input[2].call_id"),
        ("messages", "input"),  # the whole conversation (over the context)
        ("max_completion_tokens", "max_output_tokens"),
        ("response_format.json_schema.schema", "text.format.schema"),
        ("tools[0].function.parameters", "tools[0].parameters"),
        ("temperature", "temperature"),
    ],
)
def test_chats_400s_name_the_field_the_client_sent(chat_param, param):
    tool = {"type": "function", "name": "f", "parameters": {}}
    error = _own({"instructions": "Be brief.", "input": HISTORY, "tools": [tool]}, chat_param)
    assert error.param == param and str(error) == error.message == f"{param}: the image could not be decoded"
    assert (error.code, error.status) == ("bad_image", 400)


def test_chats_validation_names_the_field_the_client_sent():
    """A value only chat's own validation refuses (a text part that is not text), in the client's terms."""
    form = parse(ResponsesRequest, {"input": [*HISTORY[:3], {"role": "user", "content": [
        {"type": "input_text", "text": 7}]}]}).chat_form()  # fmt: skip
    with pytest.raises(InvalidRequest) as e:
        parse(ChatCompletionRequest, form.body)
    form.own(e.value)
    assert e.value.param == "input[3].content[0].text" and e.value.message.startswith("input[3].content[0].text: ")
    assert _own({"input": "hi"}, "messages[0].content").param == "input"
