"""Ingress deployment: OpenAI-compatible HTTP; validates, tokenizes, fans images out, streams text back."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from deployments.ingress.auth import Gate
from deployments.ingress.channel import FAILOVER_ROUTE_S, ChannelHub, TokenStream
from deployments.ingress.detokenize import OutputProcessor, TextDelta
from deployments.ingress.fetch import ImageFetcher
from deployments.ingress.grounding import GroundingTokens, pixel_boxes
from deployments.ingress.http import error_response, head_only, parse, read_json, route_path
from deployments.ingress.info import InfoRoutes
from deployments.ingress.prepare import Prepared, Preparer, image_params, sampling_params
from deployments.ingress.responses import (
    ChoiceState,
    completion,
    deadline_error,
    interleave,
    sse_stream,
    system_fingerprint,
    with_deadline,
)
from deployments.ingress.tools import parses_tools
from deployments.ingress.videos import video_urls
from schemas import (
    REPLICA_GONE,
    AppArgs,
    EncoderUnavailable,
    GenerateRequest,
    InvalidRequest,
    ModelSpec,
    Overloaded,
    observe,
    root_cause,
    this_replica,
)
from schemas.metrics import IngressMetrics
from schemas.openai import ChatCompletionRequest

logger = logging.getLogger("ray.serve")


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=256)
class Ingress:
    def __init__(self, encoder: DeploymentHandle | None, llm: DeploymentHandle, args: dict[str, Any]):
        self.encoder, self.llm = encoder, llm
        self.args = AppArgs.model_validate(args)
        self.hub = ChannelHub(llm, this_replica())  # the token channels to the LLM replicas (ingress/channel.py)
        self.prep = Preparer(self.args, ModelSpec.from_args(self.args))  # the checkpoint's facts, read once here
        self.tokenizer, self.max_model_len = self.prep.tokenizer, self.prep.max_model_len
        self.grounding = GroundingTokens.of(self.tokenizer)  # None: this family's answers carry no boxes
        self.fetcher = ImageFetcher(self.args.image_urls, self.args.limits.max_image_bytes)
        self.video_fetcher = ImageFetcher(self.args.image_urls, self.args.video.max_video_bytes)
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
        self.counts = {"encoder_retries": 0, "encoder_failures": 0, "encoder_timeouts": 0, "llm_retries": 0}
        info = InfoRoutes(self.args.model_name, self.max_model_len)
        self.routes = {
            "/v1/chat/completions": ("POST", self.chat),
            "/v1/models": ("GET", info.models),
            "/v1/models/": ("GET", info.model),  # /v1/models/{id}: a prefix (an id may hold a slash)
            "/health": ("GET", info.health),
            "": ("GET", info.playground),
        }
        self.fingerprint = system_fingerprint(self.args, self.prep.model_id)

    async def __call__(self, request: Request) -> Response:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
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
                self.gate.check(request)
            if request.method != method and (request.method, method) != ("HEAD", "GET"):
                raise InvalidRequest(f"{request.url.path} takes {method}, not {request.method}", status=405)
            response = await handler(request, request_id)
        except Exception as e:
            response = error_response(e, request_id)
            if response.status_code == 401:
                response.headers["WWW-Authenticate"] = "Bearer"
        return head_only(response) if request.method == "HEAD" else response

    async def stats(self) -> dict[str, int]:
        """Images re-encoded after their encoder replica went away, requests that gave up on them (503), and
        requests sent again after their LLM replica went away."""
        return dict(self.counts)

    async def chat(self, request: Request, request_id: str) -> Response:
        started = time.monotonic()
        timeout_s = self.args.limits.request_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout_s
        req = parse(ChatCompletionRequest, await read_json(request, self.args.limits.max_request_bytes))
        try:
            async with asyncio.timeout_at(deadline) as budget:
                self.prep.check(req)
                fetched = await self.fetcher.fetch_all([(param, url) for _, param, url in image_params(req)])
                fetched |= await self.video_fetcher.fetch_all(video_urls(req))
                p = await asyncio.to_thread(self.prep.prepare, req, fetched)
                streams, firsts = await self._start(req, p, request_id)
        except TimeoutError:
            if not budget.expired():
                raise
            raise deadline_error(timeout_s) from None
        log = {
            "id": request_id,
            "prompt": len(p.prompt),
            "images": len(p.images),
            "started": started,
            "ttft": time.monotonic() - started,
            "dropped": p.dropped_messages,
        }
        self.metrics.ttft.observe(log["ttft"])
        if len(p.images) > p.num_videos:  # NOTE: Ray counters refuse inc(0)
            self.metrics.images.inc(len(p.images) - p.num_videos)
        self.metrics.on_videos(p.video_stats)
        head = {
            "id": request_id,
            "created": int(time.time()),
            "model": self.args.model_name,
            "system_fingerprint": self.fingerprint,
        }
        events = with_deadline(interleave(firsts, streams), deadline, timeout_s)
        headers = {"X-Dropped-Messages": str(p.dropped_messages)} if p.dropped_messages else None
        boxes = functools.partial(
            pixel_boxes,
            marks=self.grounding,
            tokenizer=self.tokenizer,
            image_sizes=p.image_sizes,
            image_numbers=p.image_numbers,
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

    async def _encode(self, p: Prepared, indices: list[int], calls: list[DeploymentResponse]) -> list[Any]:
        """One encoder call per image (and per chunk of a video), concurrently; only ObjectRefs come back (the
        ingress never holds embeddings). The calls are added to `calls`, to be cancelled if the request ends early."""
        responses = [self.encoder.encode.remote(p.jobs[i], p.job_keys[i]) for i in indices]
        calls += responses
        refs = asyncio.gather(*(r._to_object_ref() for r in responses))
        refs.add_done_callback(observe)  # a request that ends early leaves it failing unobserved
        try:
            return list(await asyncio.wait_for(refs, self.args.encoder.timeout_s))
        except TimeoutError:
            self.counts["encoder_timeouts"] += 1
            raise Overloaded("no encoder replica took the images in time", retry_after_s=2) from None

    async def _start(self, req: ChatCompletionRequest, p: Prepared, request_id: str):
        """Encode the images and start the n generations, up to their first tokens (so an early error still gets
        its own status). Images whose encoder replica went away are encoded once more; a second loss is a 503."""
        if self.encoder is None:  # colocated mode: the LLM replica gets the bytes and encodes them itself
            return await self._generate(req, p, [], request_id)
        calls: list[DeploymentResponse] = []
        try:
            return await self._encode_and_generate(req, p, request_id, calls)
        except BaseException:  # client gone, deadline, or an error: images still queued are not encoded
            for call in calls:
                call.cancel()
            raise

    async def _encode_and_generate(
        self, req: ChatCompletionRequest, p: Prepared, request_id: str, calls: list[DeploymentResponse]
    ):
        refs = await self._encode(p, list(range(len(p.jobs))), calls)
        for attempt in (1, 2):
            try:
                return await self._generate(req, p, refs, request_id)
            except Exception as e:
                cause = root_cause(e)
                if not isinstance(cause, EncoderUnavailable):
                    raise
                if attempt == 2:
                    self.counts["encoder_failures"] += 1
                    raise Overloaded(
                        "image encoding failed twice; the encoder tier is recovering", retry_after_s=2
                    ) from e
                logger.warning("%s: %s; retrying them once", request_id, cause.message)
                self.counts["encoder_retries"] += len(cause.image_indices)
                for i, ref in zip(cause.image_indices, await self._encode(p, cause.image_indices, calls), strict=True):
                    refs[i] = ref
        raise AssertionError("unreachable")

    async def _generate(self, req: ChatCompletionRequest, p: Prepared, refs: list[Any], request_id: str):
        """The n generations, up to their first chunks. An LLM replica lost before them: all once more (Serve's
        router routes around a dead replica), waiting at most FAILOVER_ROUTE_S for a replica to take each, else 503."""
        channel = self.hub.id if self.args.llm.token_channel else None
        requests = [
            GenerateRequest(
                f"{request_id}-{i}",
                p.prompt,
                p.grids,
                refs,
                sampling_params(req, p.max_tokens, i, p.grammar),
                p.image_keys,
                p.images if self.encoder is None else [],
                p.routing_key or None,
                channel,
                p.second_per_grid_ts if p.num_videos else [],
                p.jobs_per_item if len(p.jobs) > len(p.images) else [],
            )
            for i in range(req.n)
        ]
        for route_timeout_s in (None, FAILOVER_ROUTE_S):
            call = self.llm.options(stream=True).generate.remote
            streams = [
                self._events(TokenStream(self.hub, call(r), r.request_id, route_timeout_s), req.stop) for r in requests
            ]
            try:
                return streams, list(await asyncio.gather(*(anext(s) for s in streams)))
            except BaseException as e:
                await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
                if route_timeout_s is not None or not isinstance(root_cause(e), REPLICA_GONE):
                    raise
                logger.warning("%s: its LLM replica went away before the first token (%r); once more", request_id, e)
                self.counts["llm_retries"] += 1
        raise AssertionError("unreachable")

    async def _events(self, gen: TokenStream, stops: list[str]) -> AsyncIterator[TextDelta]:
        """One choice's token chunks -> text deltas; a stop string ends it (and cancels its generation)."""
        out, engine_done = OutputProcessor(self.tokenizer, stops), False
        try:
            async for chunk in gen:
                engine_done = chunk.finish_reason is not None
                delta = out.feed(chunk)
                yield delta
                if delta.finish_reason is not None:
                    return
            raise RuntimeError("the generation stream ended without a finish reason")
        finally:
            # Frees the LLM's sequence when the client left or a stop string hit. NOT after the engine's own last
            # chunk: cancelling a task that is returning races Ray's bookkeeping of its result (seen crashing
            # the ingress's core worker when results go through plasma).
            gen.close(cancel=not engine_done)

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
