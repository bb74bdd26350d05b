"""The bad-input suite: each input gets its clear status and OpenAI error body (type, param, code), costs nothing
else, and the app keeps serving. Through the deployed app, over HTTP, streaming and not."""

from __future__ import annotations

import base64
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image
from ray import serve

from demo.inputs import data_url, image_bytes, make_image
from tests.api_schema import assert_valid
from tests.security.image_server import image_server

pytestmark = pytest.mark.e2e
INVALID, SERVER = "invalid_request_error", "server_error"
IMG = "messages[0].content[0].image_url"


def _user(*parts, **fields) -> dict:
    return {"messages": [{"role": "user", "content": list(parts)}], "max_tokens": 4, **fields}


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _b64(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with almost no pixel data: a decompression bomb's shape."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


PNG = image_bytes(make_image(64, 64))


def _deep_schema(levels: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _cases(server: str, port: int, root: Path) -> dict[str, tuple]:
    """name -> (body, status, error type, param, code or None, message fragment)."""
    return {
        # The body and the schema
        "not_json": (b"{not json", 400, INVALID, None, None, "not valid JSON"),
        "not_an_object": ([1, 2, 3], 400, INVALID, None, None, "JSON object"),
        "nested_100000_deep": (b"[" * 100_000 + b"]" * 100_000, 400, INVALID, None, None, "nested too deeply"),
        "unpaired_surrogate": (
            rb'{"messages": [{"role": "user", "content": "\ud800"}]}',
            400,
            INVALID,
            None,
            None,
            "surrogate",
        ),
        "schema_60_objects_deep": (  # xgrammar's conversion grows with the cube of the depth (400: 8.7 s of a core)
            _chat(response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": _deep_schema(60)}}),
            400,
            INVALID,
            None,
            None,
            "nested too deeply (over 100 levels)",
        ),
        "tool_arguments_unpaired_surrogate": (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c", "content": "r"},
                ],
                "max_tokens": 4,
            },
            400,
            INVALID,
            "messages[1].tool_calls[0].function.arguments",
            None,
            "surrogate",
        ),  # fmt: skip
        "missing_messages": ({"model": "qwen2-vl-tiny"}, 400, INVALID, "messages", "missing", "Field required"),
        "empty_messages": ({"messages": []}, 400, INVALID, "messages", "too_short", "at least 1"),
        "unknown_role": (
            {"messages": [{"role": "robot", "content": "hi"}]},
            400,
            INVALID,
            "messages[0].role",
            None,
            "'system', 'developer', 'user', 'assistant' or 'tool'",
        ),
        "unknown_part_type": (
            _user({"type": "audio", "audio": "x"}),
            400,
            INVALID,
            "messages[0].content[0]",
            "union_tag_invalid",
            "does not match any of the expected tags",
        ),
        "image_in_assistant_message": (
            {"messages": [{"role": "assistant", "content": [_image(_b64(PNG))]}]},
            400,
            INVALID,
            "messages[0]",
            None,
            "only accepted in user messages",
        ),
        "wrong_type": (_chat(max_tokens="many"), 400, INVALID, "max_tokens", None, ""),
        "max_tokens_zero": (_chat(max_tokens=0), 400, INVALID, "max_tokens", None, "greater than or equal to 1"),
        "temperature_too_high": (_chat(temperature=3), 400, INVALID, "temperature", None, "less than or equal to 2"),
        "top_p_zero": (_chat(top_p=0), 400, INVALID, "top_p", None, "greater than 0"),
        "negative_seed": (_chat(seed=-1), 400, INVALID, "seed", None, "greater than or equal to 0"),
        "top_logprobs_alone": (_chat(top_logprobs=3), 400, INVALID, None, None, "needs logprobs"),
        "n_zero": (_chat(n=0), 400, INVALID, "n", None, "greater than or equal to 1"),
        # The server's limits
        "n_over_limit": (_chat(n=9), 400, INVALID, "n", None, "over the limit of 8"),
        "too_many_stops": (_chat(stop=list("abcde")), 400, INVALID, "stop", None, "at most 4 stop strings"),
        "stop_too_long": (_chat(stop=["x" * 65]), 400, INVALID, "stop", None, "at most 64 characters"),
        "empty_stop": (_chat(stop=[""]), 400, INVALID, "stop", None, "must not be empty"),
        "context_too_long": (
            _chat(max_tokens=5000),
            400,
            INVALID,
            "messages",
            "context_length_exceeded",
            "context length of 1024",
        ),
        "unknown_model": (_chat(model="gpt-4o"), 404, INVALID, "model", "model_not_found", "not served"),
        "too_many_images": (
            _user(*[_image(_b64(PNG))] * 5),
            400,
            INVALID,
            "messages[0].content[4].image_url",
            None,
            "more than 4",
        ),
        "typed_placeholder": (
            _user({"type": "text", "text": "<|image_pad|>"}),
            400,
            INVALID,
            "messages",
            None,
            "reserved token",
        ),
        "typed_vision_start": (
            _user(_image(_b64(PNG)), {"type": "text", "text": "<|vision_start|><|image_pad|>"}),
            400,
            INVALID,
            "messages",
            None,
            "reserved token",
        ),
        "typed_vision_end": (
            _chat(messages=[{"role": "user", "content": "a <|vision_end|> b"}]),
            400,
            INVALID,
            "messages",
            None,
            "'<|vision_end|>'",
        ),
        "typed_video_pad": (
            _user(_image(_b64(PNG)), {"type": "text", "text": "<|video_pad|>"}),
            400,
            INVALID,
            "messages",
            None,
            "'<|video_pad|>'",
        ),
        # Image bytes
        "invalid_base64": (_user(_image("data:image/png;base64,%%%%")), 400, INVALID, IMG, None, "base64"),
        "not_base64_data_url": (
            _user(_image("data:image/png,rawbytes")),
            400,
            INVALID,
            IMG,
            None,
            "data:image/<type>;base64",
        ),
        "not_an_image": (
            _user(_image(_b64(b"plain text, not pixels"))),
            400,
            INVALID,
            IMG,
            None,
            "not a decodable image",
        ),
        "data_url_not_an_image_type": (
            _user(_image(_b64(PNG, "text/html"))),
            400,
            INVALID,
            IMG,
            None,
            "'text/html', not an image type",
        ),
        "data_url_type_disagrees": (
            _user(_image(_b64(PNG, "image/jpeg"))),
            400,
            INVALID,
            IMG,
            None,
            "declares a JPEG image, but its bytes are PNG",
        ),
        "over_pixel_cap": (
            _user(_image(data_url(Image.new("RGB", (641, 640), "red")))),
            400,
            INVALID,
            IMG,
            None,
            "over the limit of 409600",
        ),
        "decompression_bomb": (
            _user(_image(_b64(_png_header(50000, 50000)))),
            400,
            INVALID,
            IMG,
            None,
            "2500000000 pixels",
        ),
        "extreme_aspect_ratio": (
            _user(_image(data_url(make_image(402, 2)))),
            400,
            INVALID,
            IMG,
            None,
            "aspect ratio 201.0",
        ),
        "truncated_pixels": (
            _user(_image(_b64(PNG[: len(PNG) // 2]))),
            400,
            INVALID,
            "messages",
            None,
            "could not be decoded",
        ),
        "second_image_bad": (
            _user(_image(_b64(PNG)), _image(_b64(b"GIF89a nope"))),
            400,
            INVALID,
            "messages[0].content[1].image_url",
            None,
            "not a decodable image",
        ),
        # Image URLs (allowed here for any public host, plus 127.0.0.1 where the test server is)
        "unsupported_scheme": (
            _user(_image("ftp://example.com/x.png")),
            400,
            INVALID,
            IMG,
            "image_url_not_allowed",
            "'ftp'",
        ),
        "metadata_address": (
            _user(_image("http://169.254.169.254/latest/meta-data/")),
            400,
            INVALID,
            IMG,
            "image_url_forbidden",
            "non-public address",
        ),
        "private_address": (_user(_image("http://10.0.0.1/x.png")), 400, INVALID, IMG, "image_url_forbidden", ""),
        "loopback_not_exempt": (
            _user(_image(f"http://127.0.0.2:{port}/img.png")),
            400,
            INVALID,
            IMG,
            "image_url_forbidden",
            "",
        ),
        "decimal_ip": (
            _user(_image(f"http://2130706434:{port}/img.png")),
            400,
            INVALID,
            IMG,
            "image_url_forbidden",
            "",
        ),
        "hex_ip": (_user(_image(f"http://0x7f000002:{port}/img.png")), 400, INVALID, IMG, "image_url_forbidden", ""),
        "ipv4_mapped_ipv6": (
            _user(_image(f"http://[::ffff:127.0.0.2]:{port}/img.png")),
            400,
            INVALID,
            IMG,
            "image_url_forbidden",
            "",
        ),
        "ipv6_loopback": (_user(_image(f"http://[::1]:{port}/img.png")), 400, INVALID, IMG, "image_url_forbidden", ""),
        "backslash_host_confusion": (
            _user(_image(f"http://127.0.0.1:{port}\\@example.com/img.png")),
            400,
            INVALID,
            IMG,
            "invalid_image_url",
            "backslashes",
        ),
        "userinfo": (
            _user(_image(f"http://example.com@127.0.0.2:{port}/img.png")),
            400,
            INVALID,
            IMG,
            "invalid_image_url",
            "credentials",
        ),
        "redirect_to_metadata": (
            _user(_image(f"{server}/redirect?to=http://169.254.169.254/latest")),
            400,
            INVALID,
            IMG,
            "image_url_forbidden",
            "non-public address",
        ),
        "redirect_to_file": (
            _user(_image(f"{server}/redirect?to=file:///etc/passwd")),
            400,
            INVALID,
            IMG,
            "image_url_not_allowed",
            "'file'",
        ),
        "redirect_loop": (_user(_image(f"{server}/loop")), 422, INVALID, IMG, "image_url_redirects", "redirected"),
        "remote_404": (_user(_image(f"{server}/404")), 422, INVALID, IMG, "image_url_fetch_failed", "HTTP 404"),
        "remote_500": (_user(_image(f"{server}/500")), 502, SERVER, IMG, "image_url_fetch_failed", "HTTP 500"),
        "remote_slow": (_user(_image(f"{server}/slow")), 504, SERVER, IMG, "image_url_timeout", "took over 5.0 s"),
        "remote_not_an_image": (
            _user(_image(f"{server}/empty")),
            422,
            INVALID,
            IMG,
            "image_url_fetch_failed",
            "empty body",
        ),
        "file_traversal": (
            _user(_image(f"file://{root}/../../etc/passwd")),
            400,
            INVALID,
            IMG,
            "image_url_forbidden",
            "outside image_urls.file_root",
        ),
        "file_missing": (
            _user(_image(f"file://{root}/nothing.png")),
            422,
            INVALID,
            IMG,
            "image_url_fetch_failed",
            "not found",
        ),
    }


NAMES = list(_cases("http://x", 1, Path("/r")))


@pytest.fixture(scope="module")
def server():
    with image_server() as s:
        yield s


def _work() -> dict[str, int]:
    """The work the app's encoders and LLM have done, summed over their replicas: ViT forwards and the images in
    them, engine steps and their ends."""

    def total(deployment: str, keys: tuple[str, ...]) -> dict[str, int]:
        replicas = serve.get_deployment_handle(deployment, app_name="vlm").broadcast("stats").results(timeout_s=60)
        return {f"{deployment}.{k}": sum(int(r[k]) for r in replicas) for k in keys}

    return {
        **total("Encoder", ("batches", "images", "cancelled")),
        **total("LLM", ("steps", "finished", "failed", "cancelled", "prefix_queries")),
    }


def _post(client, body):
    if isinstance(body, dict):
        return client.post("/v1/chat/completions", json=body)
    return client.post(
        "/v1/chat/completions",
        content=body if isinstance(body, bytes) else str(body).encode(),
        headers={"content-type": "application/json"},
    )


# Pixels that fail to decode past a valid header are found by the Encoder, while the LLM already runs the request's
# prefill up to that image (prefill overlapped with encoding, docs/engine.md): a 400 all the same, no engine failure.
FOUND_BY_THE_ENCODER = {"truncated_pixels"}


def test_the_suite_is_at_least_thirty_inputs():
    assert len(NAMES) >= 30


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", NAMES)
def test_bad_input_is_a_clear_error(case, stream, client, server, image_root):
    body, status, kind, param, code, fragment = _cases(*server, image_root)[case]
    before = _work()
    r = _post(client, {**body, "stream": stream} if isinstance(body, dict) else body)
    assert r.status_code == status, r.text
    assert_valid("ErrorResponse", r.json())  # OpenAI's published schema (tests/api_schema)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == (kind, param) and fragment in error["message"], error
    assert code is None or error["code"] == code, error
    for leak in ("Traceback", "/work/", '.py"', "site-packages"):  # no internals in the body
        assert leak not in error["message"], error
    work = _work()
    if case in FOUND_BY_THE_ENCODER:  # the LLM may have prefilled the text before the image, nothing more
        for key in ("LLM.steps", "LLM.prefix_queries"):
            work[key] = before[key]
    assert work == before  # refused before any encoder or LLM work
    # ...and the app is still serving.
    ok = client.post("/v1/chat/completions", json=_chat(max_tokens=1))
    assert ok.status_code == 200, ok.text


def test_an_image_by_url_is_the_same_image(client, server, image_root):
    """Fetched over http, read from file_root, or sent inline: the same bytes give the same answer."""
    base, _ = server
    data = (image_root / "seven.png").read_bytes()
    answers = []
    for url in (_b64(data), f"file://{image_root}/seven.png", f"{base}/redirect?to=/img.png"):
        body = _user(
            _image(url), {"type": "text", "text": "What is it?"}, max_tokens=6, temperature=0, return_token_ids=True
        )
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        answers.append((r.json()["prompt_token_ids"], r.json()["choices"][0]["token_ids"]))
    assert answers[0] == answers[1]  # the file is the data URL's bytes
    assert len(answers[2][0]) != len(answers[0][0])  # the server's image is another (8x8) one, and it went through


def test_body_over_the_limit_is_413(client):
    r = client.post("/v1/chat/completions", content=b"x" * (3 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "over the limit" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/chat/completions", 405), ("GET", "/nope", 404), ("POST", "/v1/models", 405)],
)
def test_routes(client, method, path, status):
    r = client.request(method, path)
    assert r.status_code == status and "error" in r.json()
    assert client.get("/health").json() == {"status": "ok"}


def test_prompt_alone_over_the_context(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 1100}]})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "prompt tokens exceed the context length of 1024" in message and "max_tokens" not in message


def test_oldest_turns_dropped_on_request(client):
    turns = []
    for i in range(12):
        turns += [
            {"role": "user", "content": f"question {i} " + "word " * 60},
            {"role": "assistant", "content": f"answer {i}"},
        ]
    body = {"messages": [*turns, {"role": "user", "content": "last"}], "max_tokens": 4}
    assert client.post("/v1/chat/completions", json=body).status_code == 400
    r = client.post("/v1/chat/completions", json={**body, "context_overflow": "drop_oldest_turns"})
    assert r.status_code == 200, r.text
    dropped = int(r.headers["x-dropped-messages"])
    assert dropped > 0 and dropped % 2 == 0 and r.json()["usage"]["prompt_tokens"] + 4 <= 1024
