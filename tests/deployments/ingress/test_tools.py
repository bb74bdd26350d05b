"""Tools at the ingress: the agent-loop history through a tool-capable chat template, the request checks (400s
with `param`), and the grammar of "required" and named calls."""

from __future__ import annotations

import json

import pytest
from xgrammar.testing import _is_grammar_accept_string as accepts

from deployments.ingress.prepare import Preparer
from deployments.ingress.tools import tool_grammar
from schemas import AppArgs, InvalidRequest
from schemas.openai import ChatCompletionRequest
from tests.tool_template import with_tools_template

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
LOOP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
]


@pytest.fixture(scope="module")
def prep(checkpoint, tmp_path_factory):
    tools_checkpoint = with_tools_template(checkpoint, tmp_path_factory.mktemp("tools") / "qwen2-vl-tiny")
    return Preparer(AppArgs(model=str(tools_checkpoint), llm={"max_model_len": 1024}))


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": LOOP, "tools": [WEATHER, TIME], **fields})


def _prompt(prep: Preparer, req: ChatCompletionRequest) -> str:
    prep.check(req)
    return prep.tokenizer.decode(prep.prepare(req, {}).prompt)


def test_an_agent_loop_renders_its_tools_call_and_result(prep):
    text = _prompt(prep, _request())
    assert json.dumps(WEATHER) in text  # the tools, as the template shows them
    # the call's arguments as an object (the template's tojson of a string would quote it), then the result
    call = '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert call + "<|im_end|>\n<|im_start|>user\n<tool_response>\n21 degrees, sunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_tool_result_as_text_parts_renders_as_its_string(prep):
    parts = [{**LOOP[2], "content": [{"type": "text", "text": "21 degrees, "}, {"type": "text", "text": "sunny"}]}]
    assert _prompt(prep, _request(messages=LOOP[:2] + parts)) == _prompt(prep, _request())


def test_tool_choice_none_still_shows_the_tools(prep):
    assert json.dumps(TIME) in _prompt(prep, _request(tool_choice="none"))  # as vLLM, unless told otherwise


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice"),
        ({"messages": [LOOP[0], {**LOOP[2], "tool_call_id": "call_9"}]}, "messages[1].tool_call_id"),
        (
            {"messages": [LOOP[0], {**LOOP[1], "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{"}}]}]},
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_a_request_shape_error_is_a_400_naming_its_field(prep, fields, param):
    with pytest.raises(InvalidRequest) as e:
        prep.check(_request(**fields))
    assert e.value.status == 400 and e.value.param == param


@pytest.fixture(scope="module")
def plain(checkpoint):
    return Preparer(AppArgs(model=str(checkpoint), llm={"max_model_len": 1024}))  # the tiny template: no tools


def test_a_template_that_cannot_show_tools_gets_them_in_a_system_preamble(plain):
    """The tools described in a system turn of their own, the call as the hermes block the preamble asks for, the
    result as a user turn; the template's default system message gives way to the preamble."""
    text = _prompt(plain, _request())
    system = text[: text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\n# Tools\n") and "You are a helpful assistant" not in text
    assert json.dumps(WEATHER) in system and json.dumps(TIME) in system and "<tool_call>" in system
    call = '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert call + "<|im_end|>\n<|im_start|>user\n<tool_response>\n21 degrees, sunny\n</tool_response><|im_end|>" in text
    assert "<|im_start|>tool" not in text and text.endswith("<|im_start|>assistant\n")


def test_the_preamble_joins_the_requests_system_message_and_results_share_a_turn(plain):
    two = {**CALL, "id": "call_2", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        LOOP[0],
        {**LOOP[1], "content": "Looking.", "tool_calls": [CALL, two]},
        LOOP[2],
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ]
    text = _prompt(plain, _request(messages=messages, parallel_tool_calls=False))
    assert text.count("<|im_start|>system\n") == 1 and "</tools>" in text[: text.index("Be brief.<|im_end|>")]
    assert "Call at most one function per answer." in text
    assert '<|im_start|>assistant\nLooking.\n<tool_call>\n{"name": "get_weather"' in text
    results = "<tool_response>\n21 degrees, sunny\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"
    assert f"<|im_start|>user\n{results}<|im_end|>" in text


def test_without_tools_or_tool_turns_the_messages_render_as_before(plain):
    req = ChatCompletionRequest.model_validate({"messages": LOOP[:1]})
    assert "You are a helpful assistant." in _prompt(plain, req) and "# Tools" not in _prompt(plain, req)


def _call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def test_required_and_named_grammars_accept_valid_calls_only():
    paris, now = _call("get_weather", {"city": "Paris", "unit": "c"}), _call("get_time", {})
    required = tool_grammar(_request(tool_choice="required"))
    assert accepts(required, paris) and accepts(required, now) and accepts(required, f"{paris}\n{now}")
    assert not accepts(required, _call("get_weather", {"city": "Paris", "unit": "k"}))  # outside the schema
    assert not accepts(required, _call("get_news", {})) and not accepts(required, "Sunny.")
    single = tool_grammar(_request(tool_choice="required", parallel_tool_calls=False))
    assert accepts(single, now) and not accepts(single, f"{paris}\n{now}")
    named = tool_grammar(_request(tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert accepts(named, now) and not accepts(named, paris) and not accepts(named, f"{now}\n{now}")
    assert tool_grammar(_request()) is None and tool_grammar(_request(tool_choice="none")) is None
