"""docs/clients.md's `python clients:<name>` recipes, run as written against the served tiny random checkpoint with a
tool-rendering chat template (tests/tool_template.py): their environment variables point them at the test app, and
each must run to its end: `.parse()` gives a parsed object, `json_object` a dict, the tool loop passes through a tool
result turn to an answer, the image URL is fetched. Random weights answer nonsense, so these are the grammar's doing.
The image recipe gets an http URL of a loopback server (the app's test config allows it); https differs only in TLS,
which tests/security/test_fetch.py covers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.security.image_server import Handler, image_server

pytestmark = pytest.mark.e2e

DOC = Path(__file__).resolve().parents[2] / "docs" / "clients.md"
BLOCKS = dict(re.findall(r"^```python clients:(\w+)\n(.*?)^```", DOC.read_text(), re.M | re.S))


def test_the_doc_has_its_recipes():
    assert sorted(BLOCKS) == ["image", "json", "messages", "parse", "responses", "tools"]


@pytest.fixture(scope="module")
def app(tools_app):  # tests/conftest.py
    return tools_app[0]


@pytest.fixture(scope="module")
def images():
    with image_server() as (url, _):
        yield url


@pytest.fixture
def run(app, images, monkeypatch):
    """Runs a recipe with its variables set for the test app; returns the names it defined."""
    monkeypatch.setenv("VLM_BASE_URL", f"{app.base_url}v1")
    monkeypatch.setenv("VLM_MODEL", "qwen2-vl-tiny")
    monkeypatch.setenv("VLM_IMAGE_URL", f"{images}/img.png")

    def run_block(name: str) -> dict:
        namespace: dict = {"__name__": f"clients_{name}"}
        # dont_inherit: not this module's `from __future__ import annotations` (pydantic would see strings)
        exec(compile(BLOCKS[name], f"docs/clients.md:{name}", "exec", dont_inherit=True), namespace)
        return namespace

    return run_block


def test_parse_gives_the_pydantic_object(run):
    ns = run("parse")
    assert isinstance(ns["scene"], ns["Scene"]) and isinstance(ns["scene"].box, ns["Box"])


def test_json_object_gives_an_object(run):
    ns = run("json")
    assert ns["choice"].message.content.startswith("{")  # the grammar's: the model left free answers prose
    if ns["choice"].finish_reason == "stop":
        assert isinstance(ns["answer"], dict)
    else:  # a random model's string runs to max_tokens: the recipe's other branch
        assert ns["choice"].finish_reason == "length" and "answer" not in ns


def test_the_tool_loop_answers_after_the_tool_result(run):
    messages = run("tools")["messages"]
    roles = [m["role"] for m in messages]
    assert roles[:3] == ["user", "assistant", "tool"], roles
    call_ids = {c["id"] for c in messages[1]["tool_calls"]}
    assert {m["tool_call_id"] for m in messages if m["role"] == "tool"} <= call_ids
    assert roles[-1] == "assistant" and not messages[-1].get("tool_calls")  # the loop ended on an answer


def test_the_image_url_is_fetched(run):
    Handler.seen.clear()
    assert run("image")["completion"].choices[0].message.content
    assert [s["path"] for s in Handler.seen] == ["/img.png"]


def test_the_responses_recipe_streams_an_answer_about_the_fetched_image(run):
    Handler.seen.clear()
    ns = run("responses")
    assert ns["response"].output_text == ns["text"] and ns["text"]
    assert [s["path"] for s in Handler.seen] == ["/img.png"]


def test_the_messages_recipe_answers_about_the_fetched_image(run):
    Handler.seen.clear()
    message = run("messages")["message"]
    assert message.content[0].text and message.stop_reason in ("end_turn", "max_tokens")
    assert [s["path"] for s in Handler.seen] == ["/img.png"]
