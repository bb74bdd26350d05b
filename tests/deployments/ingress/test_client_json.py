"""JSON from the client (deployments/ingress/client_json.py): the body and the JSON its strings hold are refused with
a 400 naming the field when they nest past MAX_JSON_DEPTH or hold an unpaired surrogate, before anything recurses
over them (the chat template, xgrammar's schema conversion, json.dumps)."""

from __future__ import annotations

import json

import pytest

from deployments.ingress import client_json
from deployments.ingress.grammar_cost import check_cost
from deployments.ingress.tools import check_tools
from schemas import InvalidRequest
from schemas.config import Limits
from schemas.openai import ChatCompletionRequest

LIMIT = client_json.MAX_JSON_DEPTH


def _nested(levels: int, kind: str) -> str:
    return ("[" * levels + "]" * levels) if kind == "list" else ('{"a": ' * levels + "1" + "}" * levels)


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_depth_up_to_the_limit_and_not_past_it(kind):
    assert client_json.loads(_nested(LIMIT, kind), "x") is not None
    with pytest.raises(InvalidRequest) as e:
        client_json.loads(_nested(LIMIT + 1, kind).encode(), "request body")
    assert e.value.status == 400 and e.value.message == f"request body is nested too deeply (over {LIMIT} levels)"
    with pytest.raises(InvalidRequest, match="nested too deeply"):  # past json's own recursion too
        client_json.loads(_nested(100_000, kind), "x")


def test_many_brackets_side_by_side_are_not_depth():
    """More brackets than the limit, side by side and shallow: it passes."""
    body = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "[{"}] * 300}]})
    assert len(client_json.loads(body, "request body")["messages"][0]["content"]) == 300


def _schema(levels: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_deep_schema_in_the_body_is_a_400_before_xgrammar_converts_it():
    """xgrammar's conversion grows with the cube of a schema's depth (400 objects deep: 8.7 s): a body nesting one 60
    objects deep (120 JSON levels) is refused at the read; 40 deep passes."""
    for levels, ok in ((40, True), (60, False)):
        body = json.dumps({"messages": [{"role": "user", "content": "x"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "t", "schema": _schema(levels)}}})  # fmt: skip
        if ok:
            client_json.loads(body, "request body")
        else:
            with pytest.raises(InvalidRequest, match="nested too deeply"):
                client_json.loads(body, "request body")


def test_json_held_in_strings_is_bounded_too():
    """A tool call's arguments and a schema sent as text: past the limit (or with an unpaired surrogate, escaped
    once more inside the string, so the body's check does not see it) a 400 naming the field."""
    args = "messages[1].tool_calls[0].function.arguments"
    for arguments, fragment in ((_nested(LIMIT + 1, "list"), "nested too deeply"), ('{"a": "\\ud800"}', "surrogate")):
        req = ChatCompletionRequest.model_validate({"messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                  "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c", "content": "r"}]})  # fmt: skip
        with pytest.raises(InvalidRequest) as e:
            check_tools(req)
        assert fragment in e.value.message and e.value.param == args
    deep = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"json": json.dumps(_schema(60))}}
    )
    with pytest.raises(InvalidRequest) as e:
        check_cost(deep, Limits())
    assert "nested too deeply" in e.value.message and e.value.param == "structured_outputs.json"
    not_json = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"json": "{not"}}
    )
    check_cost(not_json, Limits())  # left to xgrammar, which says what is wrong in its words
