"""HTTP helpers of the ingress: the body is read within its limit, and a client that leaves mid-body is not our
fault (no 500, no error log)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, NodeDiedError, TaskCancelledError
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import DeploymentUnavailableError
from starlette.requests import Request

from deployments.ingress.http import error_body, read_json
from schemas import ChannelLost, EncoderUnavailable, InvalidRequest


def _request(chunks: list[bytes | str | BaseException], content_length: int | None = None) -> Request:
    headers = [(b"content-length", str(content_length).encode())] if content_length is not None else []

    async def receive():
        item = chunks.pop(0)
        if isinstance(item, BaseException):  # what Ray Serve raises when the proxy cancels the request
            raise item
        if isinstance(item, str):  # an ASGI message such as http.disconnect
            return {"type": item}
        return {"type": "http.request", "body": item, "more_body": bool(chunks)}

    return Request({"type": "http", "method": "POST", "headers": headers}, receive)


def test_body_is_read_and_parsed():
    assert asyncio.run(read_json(_request([b'{"a": ', b"1}"]), 100)) == {"a": 1}


@pytest.mark.parametrize("declared", [None, 10])
def test_body_over_the_limit_is_413_whatever_content_length_says(declared):
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(read_json(_request([b"x" * 60, b"x" * 60], declared), 100))
    assert e.value.status == 413


@pytest.mark.parametrize("leaving", ["http.disconnect", TaskCancelledError()])
def test_a_client_that_leaves_mid_body_is_499_and_not_logged_as_ours(caplog, leaving):
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(read_json(_request([b'{"messages": [', leaving], 100000), 1 << 20))
    assert (e.value.status, e.value.code) == (499, "client_closed")
    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        status, _, body = error_body(e.value, "chatcmpl-x")
    assert status == 499 and body.error.code == "client_closed" and not caplog.records


@pytest.mark.parametrize(
    "deep", [b"[" * 100_000 + b"]" * 100_000, b'{"messages": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001]
)
def test_json_nested_beyond_the_decoders_depth_is_a_400(deep):
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(read_json(_request([deep]), 1 << 20))
    assert e.value.status == 400 and "nested too deeply" in e.value.message
    assert asyncio.run(read_json(_request([b"[" * 100 + b"]" * 100]), 1 << 20))  # nesting a client may well send


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe{}", b'{"seed": 1' + b"0" * 5000 + b"}"])
def test_a_body_json_cannot_read_is_a_400(body):
    """Not JSON, not UTF-8, or an integer of 5,001 digits (json.loads raises a plain ValueError past 4,300)."""
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(read_json(_request([body]), 1 << 20))
    assert e.value.status == 400 and "not valid JSON" in e.value.message


@pytest.mark.parametrize(
    "body",
    [rb'{"messages": [{"role": "user", "content": "a\ud800"}]}', rb'{"content": "\udc00"}', rb'{"m": 1, "\uD83D": [2]}',
     rb'{"stop": ["\ude00\ud83d"]}'],
)  # fmt: skip
def test_an_unpaired_surrogate_escape_is_a_400(body):
    """json.loads keeps a lone \\ud800 in a string, which the tokenizer cannot encode: a 400, not a 500 later."""
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(read_json(_request([body]), 1 << 20))
    assert e.value.status == 400 and "unpaired UTF-16 surrogate" in e.value.message


@pytest.mark.parametrize("body", [rb'{"c": "\ud83d\ude00 and \\ud800"}', '{"c": "\u00e9 \U0001f600"}'.encode()])
def test_surrogate_pairs_and_escaped_backslashes_are_kept(body):
    """An emoji as a pair of escapes (Python's json.dumps writes them so), or a literal backslash before "ud800"."""
    assert asyncio.run(read_json(_request([body]), 1 << 20))["c"].encode("utf-8")


@pytest.mark.parametrize(
    "lost", [ActorDiedError(), ActorUnavailableError("unreachable", None), NodeDiedError("n"), ChannelLost("r1")]
)
def test_a_lost_replica_is_a_503_to_retry_and_not_a_500(caplog, lost):
    """What a request sees when its replica (or node) went away after the ingress's one retry, or mid-stream; also
    when the token channel of its LLM replica was what said so (deployments/channel.py)."""
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        status, headers, body = error_body(lost, "chatcmpl-x")
    assert (status, headers, body.error.code) == (503, {"Retry-After": "5"}, "replica_lost")
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and not caplog.records[0].exc_info


def test_an_image_lost_once_the_stream_is_under_way_is_a_503_to_retry(caplog):
    """The ingress re-encodes an image lost before the first token; one lost after it (or whose encoder call was
    cancelled with its request) still fails its request, as a 503 the client may retry: never a 500."""
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        status, headers, body = error_body(EncoderUnavailable("no embeddings for images [0]", [0]), "chatcmpl-x")
    assert (status, headers, body.error.code) == (503, {"Retry-After": "2"}, "encoder_unavailable")
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and not caplog.records[0].exc_info


def test_a_deployment_whose_replicas_cannot_start_is_a_503_to_retry(caplog):
    """What Serve raises for a call to a deployment whose replicas failed to start (a failed redeploy): no 500."""
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        status, headers, body = error_body(DeploymentUnavailableError(DeploymentID("LLM", "vlm")), "chatcmpl-x")
    assert (status, headers, body.error.code) == (503, {"Retry-After": "5"}, "unavailable")
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and not caplog.records[0].exc_info
