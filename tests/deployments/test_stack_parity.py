"""Through the deployed app over HTTP, greedy output equals transformers' generate on the same checkpoint."""

from __future__ import annotations

import json

import pytest

from tests.deployments.parity import CASES, MAX_TOKENS, assert_greedy_equals_reference, openai_messages

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_transformers(case, client, checkpoint, reference):
    assert_greedy_equals_reference(client, checkpoint, reference, CASES[case])


def test_streaming_equals_non_streaming(client):
    body = {"messages": openai_messages(CASES["three_images"]), "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}
    whole = client.post("/v1/chat/completions", json=body).json()
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    tokens = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    assert text == whole["choices"][0]["message"]["content"]
    assert tokens == whole["choices"][0]["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
