"""The stream's content chunks, written without pydantic (deployments/ingress/responses.py: ContentChunks), are the JSON
that pydantic's ChatCompletionChunk writes: the same text for every delta here, whatever the content, logprobs,
token ids or choice index."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from pathlib import Path

import pytest

from deployments.ingress.prompt import load_tokenizer
from deployments.ingress.responses import ContentChunks, logprob_items, sse_stream
from schemas import TokenChunk, TokenLogprob
from schemas.openai import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    TokenLogprobOut,
    TopLogprob,
)

DEMO = Path(__file__).parents[2] / "demo" / "qwen2-vl-shapes"
HEADS = [
    {"id": "chatcmpl-0", "created": 1_700_000_000, "model": "qwen2-vl-shapes", "system_fingerprint": "fp_0123456789"},
    {"id": 'chatcmpl-"quoted"\\', "created": 0, "model": "modèle/视觉 \n"},
]
TEXTS = [
    "",
    "a",
    " world",
    'say "hi" \\ / back',
    "line\nbreak\ttab\rcr",
    "\x00\x01\x1f\x7f\x80",
    "你好，世界 🙂👍🏽 é",
    "\u2028\u2029</script>\ufffd",
    "x" * 300,
]
TOKEN_IDS = [None, [], [7], [1, 2, 151643]]
LOGPROBS = [-0.5, -0.0, 0.0, -1e-10, -123.456789012345, -1e-300, float("-inf"), float("nan")]


def _piece(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _items(n: int, top: int) -> list[dict]:
    """n tokens' logprob items with `top` alternatives each, cycling through the awkward floats and texts."""
    lps, texts = itertools.cycle(LOGPROBS), itertools.cycle(TEXTS[1:8])
    return [
        {**_piece(next(texts), next(lps)), "top_logprobs": [_piece(next(texts), next(lps)) for _ in range(top)]}
        for _ in range(n)
    ]


def _pydantic(head: dict, index: int, text: str, token_ids: list[int] | None, items: list[dict] | None) -> str:
    """The chunk as the ingress wrote it before ContentChunks: models all the way down."""
    logprobs = (
        None
        if items is None
        else ChoiceLogprobs(
            content=[
                TokenLogprobOut(
                    token=t["token"],
                    logprob=t["logprob"],
                    bytes=t["bytes"],
                    top_logprobs=[TopLogprob(**p) for p in t["top_logprobs"]],
                )
                for t in items
            ]
        )
    )
    chunk = ChatCompletionChunk(
        **head, choices=[ChunkChoice(index=index, delta=Delta(content=text), token_ids=token_ids, logprobs=logprobs)]
    )
    return f"data: {chunk.model_dump_json()}\n\n"


def _parsed(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event.removeprefix("data: "))


def _same_json(a, b) -> bool:
    """Equal as parsed JSON, NaN (never in JSON: null) aside, and -0.0 told from 0.0."""
    if isinstance(a, float) and isinstance(b, float):
        return math.copysign(1, a) == math.copysign(1, b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("items", [None, _items(1, 0), _items(2, 3)], ids=["no_logprobs", "logprob", "top3"])
@pytest.mark.parametrize("token_ids", TOKEN_IDS, ids=["no_ids", "empty_ids", "one_id", "three_ids"])
def test_a_content_chunk_is_what_pydantic_writes(token_ids, items):
    for head, index, text in itertools.product(HEADS, (0, 1, 7), TEXTS):
        fast = ContentChunks(head).content(index, text, token_ids, items)
        slow = _pydantic(head, index, text, token_ids, items)
        assert _same_json(_parsed(fast), _parsed(slow)), (fast, slow)
        assert fast == slow  # byte for byte, as well


def test_a_huge_logprob_is_written_in_another_exponent_form_but_parses_the_same():
    """msgspec writes 1e38 where pydantic writes 1e+38: both JSON, the same number."""
    items = [{**_piece("a", -3.4028234663852886e38), "top_logprobs": []}]
    fast, slow = ContentChunks(HEADS[0]).content(0, "a", None, items), _pydantic(HEADS[0], 0, "a", None, items)
    assert _same_json(_parsed(fast), _parsed(slow))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO)


def test_logprob_items_decode_each_token_as_the_tokenizer_does(tokenizer):
    ids = tokenizer.encode("a red 圆 🙂", add_special_tokens=False) + [tokenizer.eos_token_id]
    lps = [TokenLogprob(-0.25, [(t, -0.25), ((t + 1) % len(tokenizer), -2.0)]) for t in ids]
    items = logprob_items(tokenizer, ids, lps)
    assert [it["token"] for it in items] == [tokenizer.decode([t]) for t in ids]
    assert [it["top_logprobs"][1]["token"] for it in items] == [
        tokenizer.decode([(t + 1) % len(tokenizer)]) for t in ids
    ]
    assert all(it["bytes"] == list(it["token"].encode()) for it in items)
    ChoiceLogprobs(content=items)  # the model's fields, no more, no fewer


@pytest.mark.parametrize("fields", [{}, {"logprobs": True, "top_logprobs": 2}, {"return_token_ids": True}])
def test_the_streams_content_chunks_are_what_pydantic_writes(tokenizer, fields):
    """Through sse_stream, n=2: each content event against the chunk pydantic writes for the same delta."""
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2, **fields}
    )
    deltas = []
    for i, text in enumerate(['It is "the" red\ncircle 🙂', "a 圆"]):
        ids = tokenizer.encode(text, add_special_tokens=False)
        for k, t in enumerate(ids):
            lp = [TokenLogprob(-0.5, [(t, -0.5), (t + 1, -1.5)])] if req.logprobs else None
            deltas.append((i, TokenChunk([t], "stop" if k == len(ids) - 1 else None, lp, text=tokenizer.decode([t]))))

    async def collect():
        async def events():
            for item in deltas:
                yield item

        return [
            e async for e in sse_stream(req, HEADS[0], [1, 2], events(), tokenizer, "chatcmpl-0", lambda choices: None)
        ]

    events = asyncio.run(collect())
    content = [e for e in events if '"delta":{"content"' in e]
    assert len(content) == len(deltas)
    for event, (i, d) in zip(content, deltas, strict=True):
        items = None if d.logprobs is None else logprob_items(tokenizer, d.token_ids, d.logprobs)
        assert event == _pydantic(HEADS[0], i, d.text, d.token_ids if req.return_token_ids else None, items)
