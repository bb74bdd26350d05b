"""Bad input gets a clear 4xx with an OpenAI error body, costs nothing else, and the app keeps serving."""

from __future__ import annotations

import base64

import pytest
from PIL import Image

from tests.helpers import data_url, image_bytes, make_image

pytestmark = pytest.mark.e2e


def _user(*parts) -> dict:
    return {"messages": [{"role": "user", "content": list(parts)}], "max_tokens": 4}


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _b64(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


PNG = image_bytes(make_image(64, 64))
BAD = {
    "not_json": (b"{not json", 400, None, "not valid JSON"),
    "not_an_object": ([1, 2, 3], 400, None, "JSON object"),
    "missing_messages": ({"model": "qwen2-vl-tiny"}, 400, "messages", "Field required"),
    "wrong_type": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, 400, "max_tokens", ""),
    "http_url": (_user(_image("http://169.254.169.254/latest")), 400, "messages[0].content[0].image_url", "data:"),
    "invalid_base64": (_user(_image("data:image/png;base64,%%%%")), 400, "messages[0].content[0].image_url", "base64"),
    "not_an_image": (_user(_image(_b64(b"plain text, not pixels"))), 400, "messages[0].content[0].image_url",
                     "not a decodable image"),
    "over_pixel_cap": (_user(_image(data_url(Image.new("RGB", (641, 640), "red")))), 400,
                       "messages[0].content[0].image_url", "over the limit of 409600"),
    "truncated_pixels": (_user(_image(_b64(PNG[: len(PNG) // 2]))), 400, "messages", "could not be decoded"),
    "too_many_images": (_user(*[_image(_b64(PNG))] * 5), 400, "messages[0].content[4].image_url", "more than 4"),
    "typed_placeholder": (_user({"type": "text", "text": "<|image_pad|>"}), 400, "messages", "reserved token"),
    "context_too_long": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, 400, "messages",
                         "context length of 1024"),
    "unknown_model": ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model", "not served"),
    "n_over_limit": ({"messages": [{"role": "user", "content": "hi"}], "n": 9}, 400, "n", "over the limit of 8"),
    "too_many_stops": ({"messages": [{"role": "user", "content": "hi"}], "stop": list("abcde")}, 400, "stop", ""),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_clear_client_error(case, stream, client):
    body, status, param, fragment = BAD[case]
    if isinstance(body, dict):
        body = {**body, "stream": stream}
        r = client.post("/v1/chat/completions", json=body)
    else:
        r = client.post("/v1/chat/completions", content=body if isinstance(body, bytes) else str(body).encode(),
                        headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and fragment in error["message"]
    # ...and the app is still serving.
    ok = client.post("/v1/chat/completions", json=_user(_image(_b64(PNG)), {"type": "text", "text": "hi"}))
    assert ok.status_code == 200, ok.text


def test_body_over_the_limit_is_413(client):
    r = client.post("/v1/chat/completions", content=b"x" * (3 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "over the limit" in r.json()["error"]["message"]


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/v1/chat/completions", 405), ("GET", "/nope", 404),
                                                         ("POST", "/v1/models", 405)])
def test_routes(client, method, path, status):
    r = client.request(method, path)
    assert r.status_code == status and "error" in r.json()
    assert client.get("/health").json() == {"status": "ok"}


def test_prompt_alone_over_the_context(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 1100}]})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "prompt tokens exceed the context length of 1024" in message and "max_tokens" not in message
