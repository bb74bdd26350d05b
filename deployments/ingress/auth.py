"""API keys and CORS at the ingress: who may call, and from which browser origins."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

from starlette.requests import Request
from starlette.responses import Response

from schemas import AuthArgs, InvalidRequest

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


__all__ = ["Gate"]
