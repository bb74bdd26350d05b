"""Many clients at once: every request is answered, and each answer is the one it gets alone."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from demo.inputs import data_url, make_image

pytestmark = pytest.mark.e2e


def _body(i: int) -> dict:
    content = [
        {"type": "image_url", "image_url": {"url": data_url(make_image(40 + 13 * (i % 5), 50, seed=i))}}
        for _ in range(i % 3)
    ] + [{"type": "text", "text": f"Question number {i}?"}]
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
        "return_token_ids": True,
        "stream": i % 2 == 0,
    }


async def _ask(client: httpx.AsyncClient, body: dict) -> list[int]:
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not body["stream"]:
        return r.json()["choices"][0]["token_ids"]
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    return [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]


def test_concurrent_requests_all_answered_and_isolated(base_url):
    bodies = [_body(i) for i in range(24)]

    async def run(concurrent: bool):
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            if concurrent:
                return await asyncio.gather(*(_ask(client, b) for b in bodies))
            return [await _ask(client, b) for b in bodies]

    alone = asyncio.run(run(concurrent=False))
    together = asyncio.run(run(concurrent=True))
    assert together == alone
