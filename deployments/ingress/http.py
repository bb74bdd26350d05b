"""The ingress's HTTP edge: who may call (API keys, `Gate`) and from which browser origins (CORS), bounded body
reading, request parsing, errors as OpenAI error bodies, SSE."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Mapping
from typing import Any

import msgspec
from pydantic import BaseModel, ValidationError
from ray.exceptions import TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from deployments.errors import LLM_GONE, root_cause
from deployments.ingress import client_json
from schemas import AuthArgs, EncoderUnavailable, InvalidRequest, Overloaded
from schemas.openai import ErrorBody, ErrorDetail

logger = logging.getLogger("ray.serve")

_PREFLIGHT = {
    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
    "Access-Control-Allow-Headers": "Authorization, Content-Type, x-api-key",
    "Access-Control-Max-Age": "600",
}


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Gate:
    def __init__(self, args: AuthArgs, environ: Mapping[str, str] = os.environ):
        keys = [*args.api_keys, *(k.strip() for k in environ.get(args.api_keys_env, "").split(","))]
        # NOTE: compared as sha256 digests, so every comparison is 32 bytes whatever the key's length.
        self._digests = [_digest(k) for k in keys if k]
        self._origins = frozenset(args.cors_allow_origins)

    @property
    def num_keys(self) -> int:
        return len(self._digests)

    def check(self, request: Request) -> str | None:
        """401 unless auth is off or the request carries one of the keys (compared in constant time). Returns the
        key's tenant (a hash of it: each key is one tenant, whose cache entries no other sees); None: auth off."""
        if not self._digests:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" and (key := request.headers.get("x-api-key")):  # Anthropic's clients' header
            scheme, token = "bearer", key
        if scheme.lower() != "bearer" or not token.strip():
            raise InvalidRequest(
                "no API key: send the header Authorization: Bearer <key> (or x-api-key: <key>)",
                status=401,
                code="invalid_api_key",
            )
        digest, ok = _digest(token.strip()), False
        for known in self._digests:  # no early exit: the time does not say which key came close
            ok |= hmac.compare_digest(digest, known)
        if not ok:
            raise InvalidRequest("invalid API key", status=401, code="invalid_api_key")
        return hashlib.sha256(b"tenant\0" + digest).hexdigest()[:32]

    def cors_headers(self, request: Request) -> dict[str, str]:
        origin = request.headers.get("origin")
        if origin is None or not (origin in self._origins or "*" in self._origins):
            return {}
        return {
            "Access-Control-Allow-Origin": "*" if "*" in self._origins else origin,
            "Access-Control-Expose-Headers": "x-request-id, Retry-After, X-Dropped-Messages",
            "Vary": "Origin",
        }

    def preflight(self, request: Request) -> Response:
        """A browser's OPTIONS before a cross-origin call: allowed origins get the methods and headers, others 403."""
        cors = self.cors_headers(request)
        if not cors:
            return Response(status_code=403)
        headers = {**cors, **_PREFLIGHT}
        # The headers the browser asks to send, echoed (as vLLM's allow_headers=["*"]): the openai-js client sends
        # its own x-stainless-* headers, and a preflight that leaves one out fails its every call.
        if asked := request.headers.get("access-control-request-headers", "").strip():
            headers["Access-Control-Allow-Headers"] = asked
            headers["Vary"] = "Origin, Access-Control-Request-Headers"
        return Response(status_code=204, headers=headers)


async def read_json(request: Request, max_bytes: int) -> Any:
    """The body as JSON, refusing (413) to read more than `max_bytes` whatever Content-Length claims."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise InvalidRequest(f"request body is {declared} bytes, over the limit of {max_bytes}", status=413)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise InvalidRequest(f"request body is over the limit of {max_bytes} bytes", status=413)
    except (ClientDisconnect, TaskCancelledError) as e:  # the client left mid-body: not our fault, nobody to answer
        raise InvalidRequest(
            "client closed the request before its body arrived", code="client_closed", status=499
        ) from e
    return client_json.loads(body, "request body")


def _json_path(body: Any, loc: tuple) -> str:
    """pydantic's error location -> the path in the client's JSON (union member tags dropped)."""
    path, node = "", body
    for i, part in enumerate(loc):
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            path, node = (f"{path}.{part}" if path else part), node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path, node = f"{path}[{part}]", node[part]
        elif i == len(loc) - 1 and isinstance(node, dict) and isinstance(part, str):
            path = f"{path}.{part}" if path else part  # a missing field
    return path


def parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        # Of a union's alternatives, the error that got deepest into the client's JSON says the most.
        # A model-level error names its field in its context (GenerationRequest's unsupported_parameter).
        errors = [
            (_json_path(body, tuple(err["loc"])) or err.get("ctx", {}).get("param", ""), err)
            for err in e.errors(include_url=False)
        ]
        param, first = max(errors, key=lambda pe: len(pe[0]))
        msg = first["msg"].removeprefix("Value error, ")
        raise InvalidRequest(f"{param}: {msg}" if param else msg, param=param or None, code=first["type"]) from e


def error_body(e: BaseException, request_id: str) -> tuple[int, dict[str, str], ErrorBody]:
    """(status, headers, body) for an error: 4xx for the client's fault, 503 for overload or a lost or unavailable
    replica, 500 (no details) else."""
    e = root_cause(e)
    if isinstance(e, InvalidRequest):
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        # NOTE: the OpenAI (Stainless) clients retry a 408 (ours is the request's own deadline, met again), a 409
        # and a 429 unless told not to; the same request gets the same 4xx here.
        headers = {"x-should-retry": "false"} if e.status < 500 and e.status not in (409, 429) else {}
        detail = ErrorDetail(message=e.message, type=kind, param=e.param, code=e.code)
        return e.status, headers, ErrorBody(error=detail)
    # Before Overloaded: a lost token channel (ChannelLost, one of LLM_GONE) is an Overloaded too.
    if isinstance(e, LLM_GONE):  # after a retry, or with a stream under way: the client may try again
        logger.warning("request %s: its replica went away (%s)", request_id, type(e).__name__)
        message = "the replica serving this request went away; retry"
        detail = ErrorDetail(message=message, type="server_error", code="replica_lost")
        return 503, {"Retry-After": "5"}, ErrorBody(error=detail)
    if isinstance(e, EncoderUnavailable):  # an image lost with the stream under way, or its request cancelled
        logger.warning("request %s: %s", request_id, e.message)
        message = "an image of this request could not be encoded (its encoder replica went away); retry"
        detail = ErrorDetail(message=message, type="server_error", code="encoder_unavailable")
        return 503, {"Retry-After": "2"}, ErrorBody(error=detail)
    if isinstance(e, DeploymentUnavailableError):  # its replicas could not start (a failed redeploy): not a bug here
        logger.warning("request %s: %s", request_id, e.message)
        message = "no replica of the model can take requests now; retry later"
        detail = ErrorDetail(message=message, type="server_error", code="unavailable")
        return 503, {"Retry-After": "5"}, ErrorBody(error=detail)
    if isinstance(e, (Overloaded, BackPressureError)):
        retry = getattr(e, "retry_after_s", 1)
        detail = ErrorDetail(message=f"server is overloaded, retry later: {e}", type="server_error", code="overloaded")
        return 503, {"Retry-After": str(retry)}, ErrorBody(error=detail)
    logger.error("request %s failed", request_id, exc_info=e)
    detail = ErrorDetail(message=f"internal error (request {request_id})", type="server_error", code="internal_error")
    return 500, {}, ErrorBody(error=detail)


def error_response(e: BaseException, request_id: str) -> JSONResponse:
    status, headers, body = error_body(e, request_id)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def route_path(request: Request) -> str:
    """The request's path below the app's route prefix, without a trailing slash ("" for the root)."""
    return request.url.path.removeprefix(request.scope.get("root_path", "")).rstrip("/")


def head_only(response: Response) -> Response:
    """The answer to a HEAD: a GET's status and headers, without its body."""
    headers = {k: v for k, v in response.headers.items() if k != "content-length"}
    return Response(status_code=response.status_code, headers=headers)


def _plain(obj: Any) -> Any:
    """msgspec's hook for what it cannot encode: arrays and scalars with `tolist` (numpy, torch) as lists/numbers."""
    tolist = getattr(obj, "tolist", None)
    if tolist is None:
        raise NotImplementedError(f"cannot encode {type(obj).__name__} as JSON")
    return tolist()


_encode = msgspec.json.Encoder(enc_hook=_plain).encode


def json_text(obj: Any) -> str:
    """Compact JSON of plain data (dicts, lists, str, numbers, None) as pydantic's model_dump_json writes it:
    non-ASCII as UTF-8, NaN and infinities as null; only floats from 1e16 up are spelled otherwise (1e16, not
    1e+16). msgspec, as it measured faster than orjson and json (bench/sse_bench.py)."""
    return _encode(obj).decode()


def sse(payload: BaseModel | dict | str) -> str:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json()
    elif isinstance(payload, dict):
        payload = json_text(payload)
    return f"data: {payload}\n\n"


__all__ = ["Gate", "error_body", "error_response", "head_only", "json_text", "parse", "read_json", "route_path", "sse"]
