"""Ingress deployment: OpenAI-compatible HTTP; validates, tokenizes, fans images and videos out, streams text back.
Chat and text completions share one path: prepare the prompts, start their generations (generate.py), answer."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from deployments.channel import ChannelHub
from deployments.errors import quiet_client_errors, quiet_probe_timeouts
from deployments.ingress.fetch import MediaFetcher
from deployments.ingress.generate import Generator
from deployments.ingress.grounding import GroundingTokens, pixel_boxes
from deployments.ingress.http import Gate, error_response, head_only, parse, read_json, route_path
from deployments.ingress.info import InfoRoutes
from deployments.ingress.messages_api import MESSAGES, anthropic_error
from deployments.ingress.prepare import Prepared, Preparer, cache_scope, sampling_params
from deployments.ingress.responses import (
    ChoiceState,
    Rendering,
    completion,
    deadline_error,
    interleave,
    sse_stream,
    system_fingerprint,
    with_deadline,
)
from deployments.ingress.responses_api import RESPONSES
from deployments.ingress.text_completions import text_completion, text_sse_stream
from deployments.ingress.tokens import TokenRoutes
from deployments.ingress.tools import parses_tools
from deployments.metrics import IngressMetrics, heap_census
from deployments.replica import DRAIN_POLL_S, this_replica
from encoders import ModelSpec
from schemas import AppArgs, InvalidRequest
from schemas.anthropic import MessagesRequest
from schemas.completions import CompletionRequest
from schemas.openai import ChatCompletionRequest
from schemas.requests import GenerationRequest
from schemas.responses import ResponsesRequest

logger = logging.getLogger("ray.serve")


@serve.deployment(
    name="Ingress",
    ray_actor_options={"num_cpus": 0.1},
    max_ongoing_requests=256,
    graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
)
class Ingress:
    def __init__(self, encoder: DeploymentHandle | None, llm: DeploymentHandle, args: dict[str, Any]):
        self.args = AppArgs.model_validate(args)
        quiet_client_errors()
        quiet_probe_timeouts()  # Serve's routers run here: a busy replica's late answer is one line a minute
        self.hub = ChannelHub(llm, this_replica())  # the token channels to the LLM replicas (deployments/channel.py)
        spec = ModelSpec.from_args(self.args)  # the checkpoint's facts, read once here
        self.prep = Preparer(self.args, spec)
        self.tokenizer, self.max_model_len = self.prep.tokenizer, self.prep.max_model_len
        self.grounding = GroundingTokens.of(self.tokenizer)  # None: this family's answers carry no boxes
        limits = self.args.limits
        self.fetcher = MediaFetcher(self.args.image_urls, limits.max_image_bytes, self.args.video.max_video_bytes)
        self.gate = Gate(self.args.auth)
        self.metrics = IngressMetrics()
        urls = self.args.image_urls
        logger.info(
            "ingress ready: %s, API keys %s, CORS origins %s, image URLs %s, file:// %s",
            self.args.model_name,
            self.gate.num_keys or "off",
            self.args.auth.cors_allow_origins or "off",
            urls.allowed_domains if urls.allow_http else "off",
            urls.file_root or "off",
        )
        row_bytes = spec.embedding_width * 4  # float32: the cache's budget holds whatever the encoders' dtype
        self.gen = Generator(
            encoder, llm, self.hub, self.args, self.tokenizer, embedding_row_bytes=row_bytes, metrics=self.metrics
        )
        info = InfoRoutes(self.args.model_name, self.max_model_len)
        tokens = TokenRoutes(self.prep, self.fetcher, self.args.limits.max_request_bytes)
        self.routes = {
            "/v1/chat/completions": ("POST", self.chat),
            "/v1/completions": ("POST", self.completions),
            "/v1/responses": ("POST", self.responses),
            "/v1/messages": ("POST", self.messages),
            "/tokenize": ("POST", tokens.tokenize),
            "/detokenize": ("POST", tokens.detokenize),
            "/v1/models": ("GET", info.models),
            "/v1/models/": ("GET", info.model),  # /v1/models/{id}: a prefix (an id may hold a slash)
            "/health": ("GET", info.health),
            "": ("GET", info.playground),
        }
        self.fingerprint = system_fingerprint(self.args, self.prep.model_id)

    def __del__(self) -> None:
        """Serve calls this once the replica has drained its requests: its token channels end with it."""
        if (hub := getattr(self, "hub", None)) is not None:  # None: __init__ failed before it
            hub.close()

    async def __call__(self, request: Request) -> Response:
        # the completion's (the response's) id, as OpenAI's
        kind = {"/v1/completions": "cmpl-", "/v1/responses": "resp_", "/v1/messages": "msg_"}.get(
            route_path(request), "chatcmpl-"
        )
        request_id = f"{kind}{uuid.uuid4().hex}"
        if request.method == "OPTIONS":  # CORS preflight: browsers send no credentials with it
            response = self.gate.preflight(request)
        else:
            response = await self._route(request, request_id)
            response.headers.update(self.gate.cors_headers(request))
            self.metrics.responses.inc(tags={"status": str(response.status_code)})
        # NOTE: Serve's HTTP servers (its proxy and direct ingress) put the client's x-request-id, or Serve's own
        # request id (the one on Serve's log lines), on the request and append it to the response: a second one here
        # would double the header. Without them in front (in-process), ours, the id in the body.
        if "x-request-id" not in request.headers:
            response.headers["x-request-id"] = request_id
        return response

    async def _route(self, request: Request, request_id: str) -> Response:
        try:
            path = route_path(request)
            method, handler = self.routes.get(path, (None, None))
            if handler is None and path.startswith("/v1/models/"):
                method, handler = self.routes["/v1/models/"]
            if handler is None:
                raise InvalidRequest(f"no route {request.url.path}", status=404, code="not_found")
            if path not in ("/health", ""):  # health checks carry no key; the page asks for one and sends it
                request.state.tenant = self.gate.check(request)  # the key's tenant scopes the caches
            if request.method != method and (request.method, method) != ("HEAD", "GET"):
                raise InvalidRequest(f"{request.url.path} takes {method}, not {request.method}", status=405)
            response = await handler(request, request_id)
        except Exception as e:
            # Anthropic's clients read Anthropic's error body
            response = anthropic_error(e, request_id) if path == "/v1/messages" else error_response(e, request_id)
            if response.status_code == 401:
                response.headers["WWW-Authenticate"] = "Bearer"
        return head_only(response) if request.method == "HEAD" else response

    async def stats(self) -> dict[str, int]:
        """Images re-encoded after their encoder replica went away, requests that gave up on them (503), requests
        sent again after their LLM replica went away, and the embedding cache's counts (`cache_*`)."""
        cache = self.gen.cache.stats() if self.gen.cache is not None else {}
        return {**self.gen.counts, **{f"cache_{k}": v for k, v in cache.items()}}

    async def heap(self) -> dict[str, Any]:
        return heap_census()

    async def _run(
        self, req: GenerationRequest, prepare: Callable[[], Awaitable[list[Prepared]]], request_id: str, started: float
    ) -> tuple[list[Prepared], dict, Any, dict]:
        """Prepare the prompts and start their n choices each, under the request's deadline -> (the prompts, the
        response head, the (choice, delta) events, the log record)."""
        timeout_s = self.args.limits.request_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout_s - (time.monotonic() - started)
        try:
            async with asyncio.timeout_at(deadline) as budget:
                prompts = await prepare()
                defaults = self.prep.sampling_defaults
                params = [
                    [sampling_params(req, p.max_tokens, i, p.grammar, defaults) for i in range(req.n)] for p in prompts
                ]
                streams, firsts = await self.gen.start_all(prompts, params, request_id)
        except TimeoutError:
            if not budget.expired():
                raise
            raise deadline_error(timeout_s) from None
        log = {
            "id": request_id,
            "prompt": sum(len(p.prompt) for p in prompts),
            "images": sum(len(p.items) for p in prompts),
            "started": started,
            "ttft": time.monotonic() - started,
            "dropped": sum(p.dropped_messages for p in prompts),
        }
        self.metrics.ttft.observe(log["ttft"])
        if n_images := sum(len(p.images) for p in prompts):  # NOTE: Ray counters refuse inc(0)
            self.metrics.images.inc(n_images)
        for p in prompts:
            self.metrics.on_videos(p.video_stats)
        head = {
            "id": request_id,
            "created": int(time.time()),
            "model": self.args.model_name,
            "system_fingerprint": self.fingerprint,
        }
        return prompts, head, with_deadline(interleave(firsts, streams), deadline, timeout_s), log

    def _chat_prepare(self, req: ChatCompletionRequest, request: Request) -> Callable[[], Awaitable[list[Prepared]]]:
        async def prepare() -> list[Prepared]:
            self.prep.check(req)
            scope = cache_scope(getattr(request.state, "tenant", None), req.cache_salt)
            return [await asyncio.to_thread(self.prep.prepare, req, await self.fetcher.fetch_request(req), scope)]

        return prepare

    async def chat(self, request: Request, request_id: str) -> Response:
        started = time.monotonic()
        req = parse(ChatCompletionRequest, await read_json(request, self.args.limits.max_request_bytes))
        [p], head, events, log = await self._run(req, self._chat_prepare(req, request), request_id, started)
        headers = {"X-Dropped-Messages": str(p.dropped_messages)} if p.dropped_messages else None
        boxes = functools.partial(
            pixel_boxes,
            marks=self.grounding,
            tokenizer=self.tokenizer,
            image_sizes=[im.size for im in p.images],
            image_numbers=[im.number for im in p.images],
        )
        if req.stream:
            done = lambda choices: self._log(log, choices)  # noqa: E731
            return StreamingResponse(
                sse_stream(req, head, p.prompt, events, self.tokenizer, request_id, done, boxes, parses_tools(req)),
                media_type="text/event-stream",
                headers=headers,
            )
        body, choices = await completion(req, head, p.prompt, events, self.tokenizer, boxes, parses_tools(req))
        self._log(log, choices)
        return JSONResponse(body.model_dump(), headers=headers)

    async def responses(self, request: Request, request_id: str) -> Response:
        """POST /v1/responses: OpenAI's Responses API (schemas/responses.py, deployments/ingress/responses_api.py)."""
        return await self._translated(request, request_id, ResponsesRequest, RESPONSES)

    async def messages(self, request: Request, request_id: str) -> Response:
        """POST /v1/messages: Anthropic's Messages API (schemas/anthropic.py, deployments/ingress/messages_api.py)."""
        return await self._translated(request, request_id, MessagesRequest, MESSAGES)

    async def _translated(self, request: Request, request_id: str, wire: type, api: Rendering) -> Response:
        """A route whose request is chat's in another wire format (`wire.chat_form()`): run as chat, one choice,
        answered in its own format (`api`: a body, or its events when streamed); a 4xx of chat's checks names the
        client's field, not chat's."""
        started = time.monotonic()
        wreq = parse(wire, await read_json(request, self.args.limits.max_request_bytes))
        chat = wreq.chat_form()
        try:
            req = parse(ChatCompletionRequest, chat.body)
            [p], _, events, log = await self._run(req, self._chat_prepare(req, request), request_id, started)
        except InvalidRequest as e:
            chat.own(e)
            raise
        state = api.state(wreq, req, request_id, self.args.model_name, len(p.prompt))
        tools = parses_tools(req)
        if wreq.stream:
            done = lambda choices: self._log(log, choices)  # noqa: E731
            return StreamingResponse(api.stream(state, events, tools, request_id, done), media_type="text/event-stream")
        body, choice = await api.body(state, events, tools)
        self._log(log, [choice])
        return JSONResponse(body)

    async def completions(self, request: Request, request_id: str) -> Response:
        """POST /v1/completions: plain prompts, no chat template, no images; the same engine path as chat."""
        started = time.monotonic()
        req = parse(CompletionRequest, await read_json(request, self.args.limits.max_request_bytes))

        async def prepare() -> list[Prepared]:
            scope = cache_scope(getattr(request.state, "tenant", None), req.cache_salt)
            return await asyncio.to_thread(self.prep.prompts, req, scope)

        prompts, head, events, log = await self._run(req, prepare, request_id, started)
        if req.stream:
            done = lambda choices: self._log(log, choices)  # noqa: E731
            return StreamingResponse(
                text_sse_stream(req, head, prompts, events, self.tokenizer, request_id, done),
                media_type="text/event-stream",
            )
        body, choices = await text_completion(req, head, prompts, events, self.tokenizer)
        self._log(log, choices)
        return JSONResponse(body.model_dump())

    def _log(self, log: dict, choices: list[ChoiceState]) -> None:
        finish = ",".join(str(c.finish_reason) for c in choices)
        total = time.monotonic() - log["started"]
        self.metrics.e2e.observe(total)
        logger.info(
            "%s prompt=%d images=%d completion=%d finish=%s ttft=%.0fms total=%.0fms%s",
            log["id"],
            log["prompt"],
            log["images"],
            sum(len(c.token_ids) for c in choices),
            finish,
            log["ttft"] * 1000,
            total * 1000,
            f" dropped={log['dropped']}" if log["dropped"] else "",
        )
