"""The ingress's routes and headers, in-process (no Serve), through Starlette's client and the `openai` client:
GET /v1/models/{id}, HEAD, x-request-id, x-should-retry. (CORS: test_auth.py.)"""

from __future__ import annotations

import re

import openai
import pytest
from starlette.requests import Request
from starlette.testclient import TestClient

from demo.inputs import data_url, image_bytes, make_image
from deployments.ingress import Ingress
from tests.api_schema import assert_valid

NAME = "org/tiny-vl"  # a served name with a slash, as hub ids have: the openai client sends it as org%2Ftiny-vl
PNG = image_bytes(make_image(32, 32))
HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _client(checkpoint, **args) -> tuple[TestClient, list[str]]:
    """The ingress without Serve and without an LLM (a chat that gets as far as generating is a 500), and the
    methods and paths of the calls that reached it."""
    return _client_of(Ingress.func_or_class(None, None, {"model": str(checkpoint), "served_model_name": NAME, **args}))


def _client_of(ingress) -> tuple[TestClient, list[str]]:
    calls: list[str] = []

    async def app(scope, receive, send):
        calls.append(f"{scope['method']} {scope['path']}")
        response = await ingress(Request(scope, receive))
        await response(scope, receive, send)

    return TestClient(app, base_url="http://ingress"), calls


@pytest.fixture(scope="module")
def ingress(checkpoint):
    return _client(checkpoint)


def _oai(client: TestClient, max_retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://ingress/v1", api_key="k", http_client=client, max_retries=max_retries)


def test_models_retrieve_gives_the_served_models_card(ingress):
    client, _ = ingress
    r = client.get(f"/v1/models/{NAME}")
    assert r.status_code == 200 and r.json()["id"] == NAME and r.json()["max_model_len"]
    assert_valid("Model", r.json())
    assert _oai(client).models.retrieve(NAME).id == NAME  # percent-encoded slash included


@pytest.mark.parametrize("model_id", ["gpt-4o", "org/other", "tiny-vl", f"{NAME}/more"])
def test_an_unknown_model_id_is_a_404_with_the_openai_body(ingress, model_id):
    client, _ = ingress
    r = client.get(f"/v1/models/{model_id}")
    assert r.status_code == 404, r.text
    assert_valid("ErrorResponse", r.json())
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        _oai(client).models.retrieve(model_id)


def test_head_answers_get_routes_without_a_body(ingress):
    client, _ = ingress
    for path in ("/health", "/v1/models", f"/v1/models/{NAME}"):
        r = client.head(path)
        assert r.status_code == 200 and r.content == b"", path
    assert client.head("/v1/models/nope").status_code == 404
    assert client.head("/v1/chat/completions").status_code == 405  # a POST route


def test_every_response_carries_a_request_id(ingress):
    client, _ = ingress
    responses = [
        client.get("/health"),
        client.get("/v1/models/nope"),
        client.post("/v1/chat/completions", content=b"{"),
        client.options("/v1/models", headers={"Origin": "https://a.example"}),
    ]
    ids = [r.headers["x-request-id"] for r in responses]
    assert all(re.fullmatch(r"chatcmpl-[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == len(ids)
    # The id is the one our log and a 500's body name.
    failed = client.post("/v1/chat/completions", json=HI)  # no LLM here: our fault
    assert failed.status_code == 500 and failed.headers["x-request-id"] in failed.json()["error"]["message"]
    # A request that carries one (the client's, or the one Serve's HTTP server put there) gets it back from Serve's
    # middleware, which appends it to the response: the ingress adds no second one (tests/deployments checks Serve's).
    assert "x-request-id" not in client.get("/health", headers={"x-request-id": "trace-42"}).headers


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status"),
    [
        ("POST", "/v1/chat/completions", {"content": b"{"}, 400),
        ("POST", "/v1/chat/completions", {"json": {**HI, "model": "gpt-4o"}}, 404),
        ("GET", "/v1/chat/completions", {}, 405),
        ("POST", "/v1/chat/completions", {"content": b"x" * 2048, "headers": {"content-length": str(64 << 20)}}, 413),
    ],
)
def test_deterministic_errors_say_do_not_retry(ingress, method, path, kwargs, status):
    client, _ = ingress
    r = client.request(method, path, **kwargs)
    assert r.status_code == status and r.headers["x-should-retry"] == "false", r.text


def test_overload_and_our_own_faults_stay_retryable(ingress):
    client, _ = ingress
    r = client.post("/v1/chat/completions", json=HI)
    assert r.status_code == 500 and "x-should-retry" not in r.headers


def test_the_deadline_408_is_not_retried_by_the_openai_client(checkpoint):
    """Stainless clients retry a 408 twice unless the server says not to: one call, not three."""
    client, calls = _client(checkpoint, limits={"request_timeout_s": 1e-9})
    with pytest.raises(openai.APIStatusError) as e:
        _oai(client, max_retries=2).chat.completions.create(model=NAME, **HI)
    assert e.value.status_code == 408 and e.value.response.headers["x-should-retry"] == "false"
    assert calls == ["POST /v1/chat/completions"]


def test_auth_errors_say_do_not_retry(checkpoint):
    client, _ = _client(checkpoint, auth={"api_keys": ["right"]})
    r = client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.headers["x-should-retry"] == "false" and r.headers["x-request-id"]


def test_a_chat_template_error_is_a_400_with_the_openai_body(checkpoint):
    """A template's raise_exception (here: roles must alternate) is the request's fault, not a 500."""
    ingress = Ingress.func_or_class(None, None, {"model": str(checkpoint), "served_model_name": NAME})
    ingress.prep.tokenizer.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    client, _ = _client_of(ingress)
    body = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "max_tokens": 2}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert_valid("ErrorResponse", r.json())
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    assert "roles must alternate" in error["message"]


def test_a_body_nested_100000_deep_is_a_400_with_the_openai_body(ingress):
    client, _ = ingress
    r = client.post("/v1/chat/completions", content=b"[" * 100_000 + b"]" * 100_000)
    assert r.status_code == 400, r.text
    assert_valid("ErrorResponse", r.json())
    assert "nested too deeply" in r.json()["error"]["message"] and r.headers["x-should-retry"] == "false"


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        (data_url(PNG).replace("image/png", "text/html"), "'text/html', not an image type"),
        (data_url(PNG).replace("image/png", "image/gif"), "declares a GIF image, but its bytes are PNG"),
    ],
)
def test_a_data_url_that_is_not_the_image_type_it_declares_is_a_400(ingress, url, fragment):
    client, _ = ingress
    image = {"type": "image_url", "image_url": {"url": url}}
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [image]}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[0].content[0].image_url" and fragment in r.json()["error"]["message"]
