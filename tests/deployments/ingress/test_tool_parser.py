"""The hermes tool-call parser: whole answers, and streamed in any split, which must equal the whole answer's."""

from __future__ import annotations

import json
import random
import re

import pytest

from deployments.ingress.tool_parser import ToolCallParser, call_id, parse

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def _calls(text: str) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parse(text)[1]]


def test_one_call_alone_has_no_content():
    content, calls = parse(WEATHER)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", calls[0].id)
    assert call_id() != call_id()


def test_several_calls_and_the_text_around_them():
    content, _ = parse(f"Let me look.\n{WEATHER}\n{TIME}\nDone.")
    assert content == "Let me look.\n\n\nDone."
    assert _calls(f"Let me look.\n{WEATHER}\n{TIME}\nDone.") == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("get_time", {}),
    ]


def test_text_without_calls_is_content():
    assert parse("The answer is 42 < 43.") == ("The answer is 42 < 43.", [])
    assert parse("  \n") == (None, [])


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>',  # malformed JSON
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n["get_weather"]\n</tool_call>',  # not an object
        '<tool_call>\n{"name": "f", "arguments": "x"}\n</tool_call>',  # arguments not an object
    ],
)
def test_a_block_that_is_not_a_call_stays_content(block):
    content, calls = parse(f"Hm. {block} ok")
    assert calls == [] and content == f"Hm. {block} ok"
    content, calls = parse(f"{block}\n{TIME}")  # the good one beside it is still a call
    assert content == block and [c.name for c in calls] == ["get_time"]


def test_an_unclosed_block_at_the_end_is_a_call_when_its_json_is_whole():
    assert _calls(WEATHER.removesuffix("\n</tool_call>")) == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert parse('x <tool_call>\n{"name": "get_w') == ('x <tool_call>\n{"name": "get_w', [])


def test_max_calls_keeps_the_first_calls_and_drops_the_rest_whole():
    """parallel_tool_calls: false -> max_calls 1: the first call; later ones are neither calls nor content."""
    text = f"Let me look.\n{WEATHER}\n{TIME}\nDone."
    content, calls = parse(text, max_calls=1)
    assert content == "Let me look.\n\n\nDone." and [c.name for c in calls] == ["get_weather"]
    assert [c.name for c in parse(text, max_calls=2)[1]] == ["get_weather", "get_time"]
    first = [(calls[0].name, calls[0].arguments)]
    assert _streamed(text, list(range(1, len(text))), max_calls=1)[:2] == (content, first)


def _streamed(
    text: str, cuts: list[int], max_calls: int | None = None
) -> tuple[str | None, list[tuple[str, str]], list[str]]:
    parser, content, calls, pieces = ToolCallParser(max_calls), "", [], []
    bounds = [0, *sorted(cuts), len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        out, new = parser.feed(text[a:b])
        content += out
        pieces.append(out)
        calls += [(c.name, c.arguments) for c in new]
    out, new = parser.finish()
    content += out
    calls += [(c.name, c.arguments) for c in new]
    return content or None, calls, pieces


ANSWERS = [
    WEATHER,
    f"Checking the weather <tool_call and time.\n{WEATHER}\n{TIME}\n",
    f"  <tool_ <tool_call>\n{{bad json</tool_call> then {TIME} and text < after",
    "no calls at all, just <tool text",
    f"{TIME}{TIME}{WEATHER[:40]}",
]


@pytest.mark.parametrize("text", ANSWERS)
def test_any_split_of_a_stream_equals_the_whole(text):
    content, calls = parse(text)
    whole = (content, [(c.name, c.arguments) for c in calls])
    rng = random.Random(len(text))
    splits = [list(range(1, len(text)))]  # one character at a time
    splits += [rng.sample(range(1, len(text)), k=rng.randint(1, min(12, len(text) - 1))) for _ in range(40)]
    for cuts in splits:
        got_content, got_calls, pieces = _streamed(text, cuts)
        assert (got_content, got_calls) == whole, cuts


def test_text_that_may_open_a_call_is_held_back():
    parser = ToolCallParser()
    assert parser.feed("Sure <tool_c") == ("Sure", [])  # the space waits for what follows it
    assert parser.feed("all>\n{") == ("", [])
    content, calls = parser.feed('"name": "get_time", "arguments": {}}\n</tool_call>')
    assert content == "" and [c.name for c in calls] == ["get_time"]
    assert parser.feed(" <tool") == ("", [])
    assert parser.feed("s are fine") == ("  <tools are fine", [])  # the held space, then this one
