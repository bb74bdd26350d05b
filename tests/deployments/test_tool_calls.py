"""Tool calls through the deployed app with the `openai` client, on the tiny random checkpoint with a tool-capable
chat template (tests/tool_template.py): "required" and a named tool give calls whose arguments validate against
the tool's schema (random weights: the grammar's doing), the tool-result turn answers, a stream's deltas reassemble
to the unstreamed answer, and every body is OpenAI's published shape. On the session's app (the tiny template,
which cannot show tools) the tools go in a system preamble."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.api_schema import assert_valid

pytestmark = pytest.mark.e2e

# NOTE: bounded strings: a random model fills an unbounded one until max_tokens (valid, but cut).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def app(tools_app):  # tests/conftest.py
    return tools_app[0]


@pytest.fixture(scope="module")
def oai(app):
    return openai.OpenAI(base_url=f"{app.base_url}v1", api_key="unused", max_retries=0, timeout=120)


def _valid_calls(choice) -> list:
    assert choice.finish_reason == "tool_calls", choice
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return choice.message.tool_calls


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_gives_valid_calls(oai, seed):
    out = oai.chat.completions.create(
        model="qwen2-vl-tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
        max_tokens=300,
    )  # fmt: skip
    assert len(_valid_calls(out.choices[0])) >= 1 and out.choices[0].message.content is None


def test_a_named_tool_gives_one_call_of_it(oai):
    out = oai.chat.completions.create(
        model="qwen2-vl-tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=5,
        max_tokens=300,
    )  # fmt: skip
    assert [c.function.name for c in _valid_calls(out.choices[0])] == ["get_weather"]


def test_the_tool_result_turn_answers(oai):
    first = oai.chat.completions.create(
        model="qwen2-vl-tiny", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=300
    )
    call = _valid_calls(first.choices[0])[0]
    history = [
        *MESSAGES,
        first.choices[0].message.model_dump(exclude_none=True),  # the assistant's turn, as an agent loop sends it
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'},
    ]
    second = oai.chat.completions.create(
        model="qwen2-vl-tiny", messages=history, tools=TOOLS, temperature=0, max_tokens=8
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the call and its result are in the prompt: it grew by more than the call's arguments
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def _body(**fields) -> dict:
    return {"messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 300, **fields}


def test_streamed_deltas_reassemble_to_the_answer(app):
    for choice in ("required", NAMED):
        r = app.post("/v1/chat/completions", json=_body(tool_choice=choice))
        assert r.status_code == 200, r.text
        whole = r.json()
        assert_valid("CreateChatCompletionResponse", whole)
        chunks = _stream(app, _body(tool_choice=choice, stream=True))
        calls: dict[int, dict] = {}
        content, finish = "", None
        for chunk in chunks:
            assert_valid("CreateChatCompletionStreamResponse", chunk)
            delta = chunk["choices"][0]["delta"]
            content += delta.get("content") or ""
            finish = chunk["choices"][0]["finish_reason"] or finish
            for d in delta.get("tool_calls") or []:
                if "id" in d:  # a call's first delta: id, type and name
                    assert d["index"] == len(calls) and d["type"] == "function"
                    calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
        message = whole["choices"][0]["message"]
        assert finish == whole["choices"][0]["finish_reason"] == "tool_calls"
        assert (content or None) == message["content"]
        assert list(calls.values()) == [c["function"] for c in message["tool_calls"]]


def _stream(client: httpx.Client, body: dict) -> list[dict]:
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


def test_auto_parses_the_call_the_model_writes(oai):
    """`auto`: the model answers freely, and the hermes block it writes is parsed out of its text, streamed or not.
    A random model writes no call of itself, and logit_bias cannot make it write one: a bias holds for the whole
    answer, one value per token, while a call is 70 tokens of the tiny BPE in one order, 37 distinct ones, with
    repeats. So the sampling is held to the text by vLLM's structured_outputs (a choice of one string): the tokens
    are still sampled and detokenized as any answer's, and the parser sees only that text."""
    answer = "Let me check.\n" + CALL
    ask = dict(
        model="qwen2-vl-tiny", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=120,
        extra_body={"structured_outputs": {"choice": [answer]}},
    )  # fmt: skip
    plain = oai.chat.completions.create(**ask, tool_choice="none")  # not parsed: the text as the model wrote it
    assert plain.choices[0].message.content == answer and plain.choices[0].finish_reason == "stop"
    assert not plain.choices[0].message.tool_calls
    out = oai.chat.completions.create(**ask, tool_choice="auto")
    [call] = _valid_calls(out.choices[0])
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert out.choices[0].message.content == "Let me check."
    content, calls, finish = "", {}, None
    for chunk in oai.chat.completions.create(**ask, tool_choice="auto", stream=True):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and content.strip() == "Let me check."
    [streamed] = calls.values()
    assert streamed["name"] == "get_weather" and json.loads(streamed["arguments"]) == {"city": "Paris", "days": 2}
    assert streamed["id"].startswith("call_")


def test_auto_without_parallel_tool_calls_keeps_the_first_call(oai):
    """`parallel_tool_calls: false` under `auto`: the model wrote two calls, the answer has the first alone, streamed
    or not (as vLLM, which drops the calls after the first); the dropped call's block is not content either."""
    second = CALL.replace('"Paris", "days": 2', '"Rome", "days": 3')
    ask = dict(
        model="qwen2-vl-tiny", messages=MESSAGES, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=200,
        extra_body={"structured_outputs": {"choice": [f"{CALL}\n{second}"]}},
    )  # fmt: skip
    both = oai.chat.completions.create(**ask)
    assert [json.loads(c.function.arguments)["city"] for c in _valid_calls(both.choices[0])] == ["Paris", "Rome"]
    out = oai.chat.completions.create(**ask, parallel_tool_calls=False)
    [call] = _valid_calls(out.choices[0])
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert out.choices[0].message.content is None
    calls, content = {}, ""
    for chunk in oai.chat.completions.create(**ask, parallel_tool_calls=False, stream=True):
        content += chunk.choices[0].delta.content or ""
        for d in chunk.choices[0].delta.tool_calls or []:
            calls.setdefault(d.index, "")
            calls[d.index] += d.function.arguments or ""
    assert list(calls) == [0] and json.loads(calls[0]) == {"city": "Paris", "days": 2} and not content.strip()


def test_a_template_without_tools_gets_them_in_a_system_preamble(base_url):
    """The session's app serves the tiny template, which does not name `tools`: the request is served (auto and
    required), its prompt holds the tools' description, and "required" still gives a valid call."""
    plain = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    for choice in ("auto", "required"):
        out = plain.chat.completions.create(
            model="qwen2-vl-tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=60,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        ids = out.model_extra["prompt_token_ids"]
        prompt = httpx.post(f"{base_url}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
        assert prompt.startswith("<|im_start|>system\n# Tools\n") and json.dumps(WEATHER) in prompt, prompt
        assert json.dumps(TIME) in prompt and MESSAGES[0]["content"] in prompt
        if choice == "required":
            assert len(_valid_calls(out.choices[0])) >= 1
        else:
            assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
