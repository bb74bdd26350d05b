"""Through the app, the same image and question in OpenAI's, Qwen-VL/MindIE's and text-generation-webui's formats
give the same prompt and the same greedy answer."""

from __future__ import annotations

import base64

import pytest

from demo.inputs import image_bytes, make_image

pytestmark = pytest.mark.e2e


def test_three_formats_one_request(client):
    url = "data:image/jpeg;base64," + base64.b64encode(image_bytes(make_image(120, 90, seed=3), "JPEG")).decode()
    question = "What is in the picture?"
    contents = {
        "openai": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}],
        "qwen-vl": [{"image": url}, {"text": question}],
        "webui": f'<img src="{url}">{question}',
    }
    answers = {}
    for name, content in contents.items():
        r = client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 8,
                "temperature": 0,
                "return_token_ids": True,
            },
        )
        assert r.status_code == 200, (name, r.text)
        body = r.json()
        answers[name] = (body["prompt_token_ids"], body["choices"][0]["token_ids"])
    assert answers["qwen-vl"] == answers["openai"] == answers["webui"]
    assert body["usage"]["prompt_tokens"] > 20  # the image's tokens are in the prompt, not its base64 as text


def test_a_malformed_item_is_a_400_naming_it(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [{"img": "x"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages[0].content[0]"), r.text
