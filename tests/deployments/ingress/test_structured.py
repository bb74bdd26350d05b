"""Request -> grammar at the ingress: which requests are constrained, to what, and which are a 400 naming the field."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from pydantic import ValidationError

from deployments.ingress.grammar_cost import check_cost
from deployments.ingress.structured import json_grammar, response_grammar
from schemas import InvalidRequest
from schemas.config import Limits
from schemas.openai import ChatCompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def _grammar(**fields) -> str | None:
    return response_grammar(ChatCompletionRequest(messages=MESSAGES, **fields))


def _accepts(grammar: str, text: str) -> bool:
    """Whether the grammar matches `text` exactly (xgrammar's own matcher, byte by byte)."""
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)])  # a toy vocabulary: one token per character
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar), terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_completed()


def test_free_text_has_no_grammar():
    assert _grammar() is None and _grammar(response_format={"type": "text"}) is None


def test_json_object_is_compact_json():
    g = _grammar(response_format={"type": "json_object"})
    assert _accepts(g, '{"a": [1, 2]}') and not _accepts(g, '{ "a": [1, 2]}') and not _accepts(g, "[1]")


def test_json_schema_follows_the_schema_and_its_order():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"enum": ["x"]}}, "required": ["b", "a"]}
    g = _grammar(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert _accepts(g, '{"b": 3, "a": "x"}') and not _accepts(g, '{"a": "x", "b": 3}')
    assert not _accepts(g, '{"b": 3, "a": "y"}')


def test_bounded_strings_refuse_control_characters():
    g = json_grammar({"type": "string", "maxLength": 4}, "p")  # xgrammar 0.2.8 alone lets them through
    assert _accepts(g, '"ab"') and not _accepts(g, '"a\x01"')


def test_vllm_extensions():
    assert _accepts(_grammar(structured_outputs={"choice": ["yes", "no"]}), "no")
    assert _accepts(_grammar(guided_choice=["yes", "no"]), "yes")
    assert _accepts(_grammar(guided_regex="[0-9]{2}"), "42") and not _accepts(_grammar(guided_regex="[0-9]{2}"), "4")
    assert _accepts(_grammar(guided_json={"type": "integer"}), "17")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "bogus"}}}},
         "response_format.json_schema.schema"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ],
)  # fmt: skip
def test_what_the_engine_cannot_do_is_a_400_naming_the_field(fields, param):
    with pytest.raises(InvalidRequest) as e:
        _grammar(**fields)
    assert e.value.param == param and e.value.status == 400


def test_json_schema_needs_its_schema_object():
    with pytest.raises(ValidationError, match="needs json_schema"):
        ChatCompletionRequest(messages=MESSAGES, response_format={"type": "json_schema"})


def _objects(n: int, required: int = 0) -> dict:
    props = {f"p{i}": {"type": "string"} for i in range(n)}
    return {"type": "object", "properties": props, "required": [f"p{i}" for i in range(required)]}


def test_objects_with_too_many_optional_properties_are_a_400_before_any_conversion():
    """xgrammar's compile time grows faster than the cube of an object's optional properties (2,000 took 18 s of a
    core on the tiny vocabulary): past the limit a 400, wherever the schema is; listed in `required`, any number."""
    limits = Limits(max_optional_properties=50)
    nested = {"type": "array", "items": {"type": "object", "properties": {"inner": _objects(51)}}}
    schema = {"name": "s", "schema": nested}
    tool = {"type": "function", "function": {"name": "f", "parameters": _objects(60, required=9)}}
    for fields, param in [
        ({"response_format": {"type": "json_schema", "json_schema": schema}}, "response_format.json_schema.schema"),
        ({"structured_outputs": {"json": json.dumps(nested)}}, "structured_outputs.json"),
        ({"tools": [tool], "tool_choice": "required"}, "tools[0].function.parameters"),
    ]:
        with pytest.raises(InvalidRequest, match="51 properties that are not required, over the limit of 50") as e:
            check_cost(ChatCompletionRequest(messages=MESSAGES, **fields), limits)
        assert e.value.param == param and e.value.status == 400
    fine = {"type": "json_schema", "json_schema": {"name": "s", "schema": _objects(2000, required=1950)}}
    check_cost(ChatCompletionRequest(messages=MESSAGES, response_format=fine), limits)
    # Tools under "auto" are prompt text, not a grammar; a named choice compiles only its own.
    check_cost(ChatCompletionRequest(messages=MESSAGES, tools=[tool], tool_choice="auto"), limits)
    other = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}
    named = {"type": "function", "function": {"name": "g"}}
    check_cost(ChatCompletionRequest(messages=MESSAGES, tools=[tool, other], tool_choice=named), limits)


def test_schemas_and_grammars_over_the_byte_limit_together_are_a_400():
    limits = Limits(max_schema_bytes=4096)
    schema = {"name": "s", "schema": _objects(60, required=60)}  # ~2 KiB of JSON
    tools = [{"type": "function", "function": {"name": "f", "parameters": _objects(60, required=60)}}]
    fields = {"response_format": {"type": "json_schema", "json_schema": schema}}
    check_cost(ChatCompletionRequest(messages=MESSAGES, **fields), limits)
    with pytest.raises(InvalidRequest, match="bytes together, over the limit of 4096") as e:
        check_cost(ChatCompletionRequest(messages=MESSAGES, tools=tools * 2, tool_choice="required", **fields), limits)
    assert e.value.param == "response_format.json_schema.schema"
    with pytest.raises(InvalidRequest, match="over the limit of 4096"):
        check_cost(ChatCompletionRequest(messages=MESSAGES, structured_outputs={"grammar": "x" * 5000}), limits)
