"""API keys and CORS at the ingress: its own request handling, in-process (no Serve), through Starlette's client."""

from __future__ import annotations

import openai
import pytest
from starlette.requests import Request
from starlette.testclient import TestClient

from deployments.ingress import Ingress
from deployments.ingress.http import Gate
from schemas import AuthArgs

ORIGIN = "https://chat.example"


def _client(checkpoint, auth: dict, env: dict[str, str] | None = None, monkeypatch=None) -> TestClient:
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    ingress = Ingress.func_or_class(None, None, {"model": str(checkpoint), "auth": auth})

    async def app(scope, receive, send):
        response = await ingress(Request(scope, receive))
        await response(scope, receive, send)

    return TestClient(app, base_url="http://ingress")


@pytest.fixture
def guarded(checkpoint, monkeypatch):
    return _client(
        checkpoint,
        {"api_keys": ["key-one"], "cors_allow_origins": [ORIGIN]},
        {"VLM_API_KEYS": " key-two, ,key-three "},
        monkeypatch,
    )


@pytest.mark.parametrize(
    "header",
    [None, "", "Bearer", "Bearer ", "Basic key-one", "Bearer key-on", "Bearer key-one2", "Bearer KEY-ONE", "key-one"],
)
def test_requests_without_a_valid_key_are_401(guarded, header):
    r = guarded.get("/v1/models", headers={"Authorization": header} if header is not None else {})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "invalid_request_error"
    assert "key-one" not in r.text


@pytest.mark.parametrize("key", ["key-one", "key-two", "key-three"])
def test_keys_from_config_and_env_are_accepted(guarded, key):
    r = guarded.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200 and r.json()["data"][0]["id"]


def test_chat_is_guarded_before_the_body_is_read(guarded):
    r = guarded.post("/v1/chat/completions", content=b"not even json")
    assert r.status_code == 401


def test_health_needs_no_key(guarded):
    assert guarded.get("/health").status_code == 200


def test_the_playground_page_needs_no_key_but_its_api_calls_do(guarded):
    page = guarded.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert 'id="api-key"' in page.text and "Authorization" in page.text  # the page asks for a key and sends it
    assert "http://" not in page.text and "https://" not in page.text  # one file: no CDN, nothing from elsewhere
    assert guarded.get("/v1/models").status_code == 401


def test_openai_client_raises_authentication_error(guarded):
    client = openai.OpenAI(base_url="http://ingress/v1", api_key="wrong", http_client=guarded, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    good = openai.OpenAI(base_url="http://ingress/v1", api_key="key-two", http_client=guarded, max_retries=0)
    assert len(good.models.list().data) == 1


def test_cors_preflight_and_headers(guarded):
    pre = guarded.options("/v1/chat/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 204 and pre.headers["access-control-allow-origin"] == ORIGIN
    assert "Authorization" in pre.headers["access-control-allow-headers"]
    other = guarded.options("/v1/chat/completions", headers={"Origin": "https://evil.example"})
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
    ok = guarded.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer key-one"})
    assert ok.headers["access-control-allow-origin"] == ORIGIN and ok.headers["vary"] == "Origin"
    denied = guarded.get("/v1/models", headers={"Origin": ORIGIN})  # a browser must be able to read the 401
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
    assert (
        "access-control-allow-origin" not in guarded.get("/health", headers={"Origin": "https://evil.example"}).headers
    )


def test_no_keys_means_open_and_no_cors(checkpoint, monkeypatch):
    monkeypatch.delenv("VLM_API_KEYS", raising=False)
    open_client = _client(checkpoint, {})
    r = open_client.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    assert open_client.options("/v1/models", headers={"Origin": ORIGIN}).status_code == 403


def test_gate_any_origin_and_empty_env_keys():
    gate = Gate(AuthArgs(cors_allow_origins=["*"]), environ={"VLM_API_KEYS": " , "})
    assert gate.num_keys == 0
    request = Request({"type": "http", "method": "GET", "path": "/", "headers": [(b"origin", b"https://a.example")]})
    assert gate.cors_headers(request)["Access-Control-Allow-Origin"] == "*"


@pytest.mark.e2e
def test_preflight_reaches_the_ingress_through_serve(client):
    r = client.options("/v1/models", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET"})
    assert r.status_code == 403  # the session's app allows no origins
    assert client.get("/v1/models").status_code == 200  # and has no keys


def test_preflight_echoes_the_headers_the_browser_asks_for(guarded):
    """openai-js in a browser sends x-stainless-* headers: its preflight must allow them, or every call fails."""
    asked = "authorization, content-type, x-stainless-arch, x-stainless-lang, x-stainless-retry-count"
    pre = guarded.options(
        "/v1/chat/completions",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": asked},
    )
    assert pre.status_code == 204 and pre.headers["access-control-allow-headers"] == asked
    assert "Access-Control-Request-Headers" in pre.headers["vary"]
    other = guarded.options(
        "/v1/chat/completions", headers={"Origin": "https://evil.example", "Access-Control-Request-Headers": asked}
    )
    assert other.status_code == 403 and "access-control-allow-headers" not in other.headers
    # A browser script may read the request id of an answer (and Retry-After of a 503).
    ok = guarded.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer key-one"})
    assert "x-request-id" in ok.headers["access-control-expose-headers"] and ok.headers["x-request-id"]


def test_each_key_is_its_own_tenant():
    """The tenant scopes the caches: two keys, two tenants; the same key, the same one; auth off: none."""
    gate = Gate(AuthArgs(api_keys=["key-one", "key-two"]), environ={})

    def tenant(key: str) -> str | None:
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/",
            "headers": [(b"authorization", f"Bearer {key}".encode())],
        }
        return gate.check(Request(scope))

    assert tenant("key-one") == tenant("key-one") != tenant("key-two")
    assert "key-one" not in tenant("key-one")
    assert Gate(AuthArgs(), environ={}).check(Request({"type": "http", "headers": []})) is None
