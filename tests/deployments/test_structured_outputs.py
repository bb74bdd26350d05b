"""Structured outputs through the deployed app with the `openai` client: `.parse()` with a pydantic model, a
`json_object`, a streamed `json_schema`, n > 1, and an unsupported schema as a 400. The tiny random checkpoint
answers garbage when free, so a parsed object is the grammar's doing."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Describe the shapes as JSON."}]


# NOTE: bounded numbers and strings: a random model fills an unbounded integer or string with digits and letters
# until max_tokens (valid, but cut), and the test is about validity, not the model's taste.
class Box(BaseModel):
    x: int = Field(ge=-1000, le=1000)
    label: str = Field(max_length=10)


class Scene(BaseModel):
    colour: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=99)
    box: Box
    tags: list[Annotated[str, Field(max_length=8)]] = Field(max_length=3)


@pytest.fixture
def oai(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (1.0, 1), (1.0, 2)])
def test_parse_gives_a_pydantic_object(oai, temperature, seed):
    out = oai.chat.completions.parse(
        model="qwen2-vl-tiny",
        messages=MESSAGES,
        response_format=Scene,
        temperature=temperature,
        seed=seed,
        max_tokens=300,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Scene), choice.message.content


def test_json_object_and_n_choices_load(oai):
    out = oai.chat.completions.create(
        model="qwen2-vl-tiny",
        messages=MESSAGES,
        response_format={"type": "json_object"},
        temperature=1.0,
        seed=3,
        n=3,
        max_tokens=200,
    )
    for choice in out.choices:
        if choice.finish_reason == "stop":  # a free-form object may fill max_tokens first: then it is cut
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")
    free = oai.chat.completions.create(model="qwen2-vl-tiny", messages=MESSAGES, temperature=0, max_tokens=30)
    assert not free.choices[0].message.content.startswith("{")  # the claim above is the grammar's


def test_streamed_json_schema_loads(oai):
    schema = Scene.model_json_schema()
    stream = oai.chat.completions.create(
        model="qwen2-vl-tiny",
        messages=MESSAGES,
        response_format={"type": "json_schema", "json_schema": {"name": "scene", "schema": schema, "strict": True}},
        temperature=0,
        max_tokens=300,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    Scene.model_validate_json(text)


def test_an_unsupported_schema_is_a_400_naming_it(client):
    bad = {"name": "x", "schema": {"type": "object", "properties": 3}}
    r = client.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": bad}},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "response_format.json_schema.schema"
    assert "properties must be an object" in error["message"]


def test_a_grammar_that_leads_nowhere_fails_its_own_request_alone(client):
    """vLLM's `structured_outputs.grammar`: one that matches no text is a 400 before it runs; one that dead-ends
    after its first token fails that request (a 400, or an error event once streaming), while a request generating
    beside them in the same steps ends as usual."""
    nowhere, dead_end = "root ::= root", 'root ::= "a" x\nx ::= x'

    def ask(body: dict) -> httpx.Response:
        return client.post("/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0, **body})

    with ThreadPoolExecutor(4) as pool:
        free = pool.submit(ask, {"max_tokens": 800, "ignore_eos": True, "stream": True})
        answers = list(
            pool.map(
                ask,
                [
                    {"structured_outputs": {"grammar": nowhere}},
                    {"structured_outputs": {"grammar": dead_end}},
                    {"structured_outputs": {"grammar": dead_end}, "stream": True},
                ],
            )
        )
    for r in answers[:2]:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "no token can start it" in answers[0].json()["error"]["message"]
    assert "allows no token after 1 generated" in answers[1].json()["error"]["message"]
    streamed = answers[2]
    assert streamed.status_code == 200 and "allows no token after 1 generated" in streamed.text, streamed.text
    assert free.result().status_code == 200 and '"finish_reason":"length"' in free.result().text.replace(" ", "")
    assert ask({"max_tokens": 2}).status_code == 200
