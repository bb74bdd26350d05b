"""Ingress deployment: OpenAI-compatible HTTP; validates, tokenizes, fans images out, streams text back."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from transformers import AutoConfig

from deployments.auth import Gate
from deployments.http import error_response, parse, read_json, root_cause
from deployments.responses import ChoiceState, completion, interleave, sse_stream
from encoders import decode_data_url, embedding_key, family_of, probe_image
from llm import OutputProcessor, TextDelta, build_prompt, load_tokenizer
from schemas import (AppArgs, EncoderUnavailable, GenerateRequest, InvalidRequest, Overloaded, SamplingParams,
                     resolve_max_model_len)
from schemas.openai import ChatCompletionRequest, ImagePart, ModelCard, ModelList

logger = logging.getLogger("ray.serve")


@dataclass(slots=True)
class Prepared:
    prompt: list[int] = field(default_factory=list)
    images: list[bytes] = field(default_factory=list)
    image_keys: list[str] = field(default_factory=list)
    grids: list[tuple[int, int, int]] = field(default_factory=list)
    max_tokens: int = 0


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=256)
class Ingress:
    def __init__(self, encoder: DeploymentHandle | None, llm: DeploymentHandle, args: dict[str, Any]):
        self.encoder, self.llm = encoder, llm
        self.args = AppArgs.model_validate(args)
        config = AutoConfig.from_pretrained(self.args.model)
        self.image_token_id = config.image_token_id
        self.processing = family_of(self.args.model).processing.from_pretrained(self.args.model)
        self.preprocessing_id = self.processing.fingerprint()
        config_bytes = (Path(self.args.model) / "config.json").read_bytes()
        self.model_id = hashlib.sha256(self.args.model.encode() + config_bytes).hexdigest()[:16]
        self.tokenizer = load_tokenizer(self.args.model)
        self.max_model_len = resolve_max_model_len(
            self.args.llm.max_model_len, config.text_config.max_position_embeddings)
        self.gate = Gate(self.args.auth)
        logger.info("ingress ready: %s, API keys %s, CORS origins %s", self.args.model_name,
                    self.gate.num_keys or "off", self.args.auth.cors_allow_origins or "off")
        self.counts = {"encoder_retries": 0, "encoder_failures": 0, "encoder_timeouts": 0}
        self.routes = {"/v1/chat/completions": ("POST", self.chat), "/v1/models": ("GET", self.models),
                       "/health": ("GET", self.health)}

    async def __call__(self, request: Request) -> Response:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if request.method == "OPTIONS":  # CORS preflight: browsers send no credentials with it
            return self.gate.preflight(request)
        try:
            path = request.url.path.removeprefix(request.scope.get("root_path", "")).rstrip("/")
            method, handler = self.routes.get(path, (None, None))
            if handler is None:
                raise InvalidRequest(f"no route {request.url.path}", status=404, code="not_found")
            if path != "/health":  # health checks (load balancers, Kubernetes) carry no key
                self.gate.check(request)
            if request.method != method:
                raise InvalidRequest(f"{request.url.path} takes {method}, not {request.method}", status=405)
            response = await handler(request, request_id)
        except Exception as e:
            response = error_response(e, request_id)
            if response.status_code == 401:
                response.headers["WWW-Authenticate"] = "Bearer"
        response.headers.update(self.gate.cors_headers(request))
        return response

    async def stats(self) -> dict[str, int]:
        """Images re-encoded after their encoder replica went away, and requests that gave up (503)."""
        return dict(self.counts)

    async def health(self, request: Request, request_id: str) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request, request_id: str) -> Response:
        card = ModelCard(id=self.args.model_name, max_model_len=self.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    def _prepare(self, req: ChatCompletionRequest) -> Prepared:
        """Checks, image headers, prompt ids. CPU work, no pixels."""
        limits = self.args.limits
        if req.model is not None and req.model != self.args.model_name:
            raise InvalidRequest(f"model {req.model!r} is not served here; this server serves {self.args.model_name!r}",
                                 param="model", code="model_not_found", status=404)
        if len(req.stop) > limits.max_stop or any(len(s) > limits.max_stop_chars for s in req.stop):
            raise InvalidRequest(f"at most {limits.max_stop} stop strings of at most {limits.max_stop_chars} characters",
                                 param="stop")
        if req.n > limits.max_n:
            raise InvalidRequest(f"n={req.n} is over the limit of {limits.max_n}", param="n")
        out = Prepared()
        counts = []
        for i, message in enumerate(req.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                if not isinstance(part, ImagePart):
                    continue
                param = f"messages[{i}].content[{j}].image_url"
                if len(out.images) == limits.max_images_per_request:
                    raise InvalidRequest(f"more than {limits.max_images_per_request} images in one request", param=param)
                try:
                    data = decode_data_url(part.image_url.url, limits.max_image_bytes)
                    info = probe_image(data, limits)
                except InvalidRequest as e:
                    raise InvalidRequest(f"{param}: {e.message}", param=param, code=e.code, status=e.status) from e
                out.images.append(data)
                # One key for the embedding cache and for the prefix cache of the image's tokens.
                out.image_keys.append(embedding_key(hashlib.sha256(data).hexdigest(), info.width, info.height,
                                                    info.mode, self.preprocessing_id, self.model_id))
                out.grids.append(self.processing.grid_thw(info.width, info.height))
                counts.append(self.processing.num_image_tokens(info.width, info.height))
        out.prompt = build_prompt(self.tokenizer, req.messages, self.image_token_id, counts)
        room = self.max_model_len - len(out.prompt)
        out.max_tokens = req.requested_max_tokens or min(limits.default_max_tokens, room)
        if room < 1 or out.max_tokens > room:
            asked = f" + max_tokens {out.max_tokens}" if req.requested_max_tokens else ""
            raise InvalidRequest(f"{len(out.prompt)} prompt tokens{asked} exceed the context length of "
                                 f"{self.max_model_len}", param="messages", code="context_length_exceeded")
        return out

    def _sampling(self, req: ChatCompletionRequest, max_tokens: int, choice: int) -> SamplingParams:
        seed = None if req.seed is None else (req.seed + choice) % 2**63  # n choices differ, each reproducible
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                              top_k=max(req.top_k, 0), seed=seed, presence_penalty=req.presence_penalty,
                              frequency_penalty=req.frequency_penalty, stop_token_ids=frozenset(req.stop_token_ids),
                              ignore_eos=req.ignore_eos, logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0)

    async def chat(self, request: Request, request_id: str) -> Response:
        started = time.monotonic()
        req = parse(ChatCompletionRequest, await read_json(request, self.args.limits.max_request_bytes))
        p = await asyncio.to_thread(self._prepare, req)
        log = {"id": request_id, "prompt": len(p.prompt), "images": len(p.images), "started": started}
        streams, firsts = await self._start(req, p, request_id)
        log["ttft"] = time.monotonic() - started
        head = {"id": request_id, "created": int(time.time()), "model": self.args.model_name}
        events = interleave(firsts, streams)
        if req.stream:
            done = lambda choices: self._log(log, choices)  # noqa: E731
            return StreamingResponse(sse_stream(req, head, p.prompt, events, self.tokenizer, request_id, done),
                                     media_type="text/event-stream")
        body, choices = await completion(req, head, p.prompt, events, self.tokenizer)
        self._log(log, choices)
        return JSONResponse(body.model_dump())

    async def _encode(self, p: Prepared, indices: list[int]) -> list[Any]:
        """One encoder call per image, concurrently; only ObjectRefs come back (the ingress never holds
        embeddings)."""
        calls = [self.encoder.encode.remote(p.images[i], p.image_keys[i])._to_object_ref() for i in indices]
        try:
            return list(await asyncio.wait_for(asyncio.gather(*calls), self.args.encoder.timeout_s))
        except TimeoutError:
            self.counts["encoder_timeouts"] += 1
            raise Overloaded("no encoder replica took the images in time", retry_after_s=2) from None

    async def _start(self, req: ChatCompletionRequest, p: Prepared, request_id: str):
        """Encode the images and start the n generations, up to their first tokens (so an early error still gets
        its own status). Images whose encoder replica went away are encoded once more; a second loss is a 503."""
        if self.encoder is None:  # colocated mode: the LLM replica gets the bytes and encodes them itself
            return await self._generate(req, p, [], request_id)
        refs = await self._encode(p, list(range(len(p.images))))
        for attempt in (1, 2):
            try:
                return await self._generate(req, p, refs, request_id)
            except Exception as e:
                cause = root_cause(e)
                if not isinstance(cause, EncoderUnavailable):
                    raise
                if attempt == 2:
                    self.counts["encoder_failures"] += 1
                    raise Overloaded("image encoding failed twice; the encoder tier is recovering",
                                     retry_after_s=2) from e
                logger.warning("%s: %s; retrying them once", request_id, cause.message)
                self.counts["encoder_retries"] += len(cause.image_indices)
                for i, ref in zip(cause.image_indices, await self._encode(p, cause.image_indices), strict=True):
                    refs[i] = ref
        raise AssertionError("unreachable")

    async def _generate(self, req: ChatCompletionRequest, p: Prepared, refs: list[Any], request_id: str):
        streams = [self._events(self.llm.options(stream=True).generate.remote(GenerateRequest(
            f"{request_id}-{i}", p.prompt, p.grids, refs, self._sampling(req, p.max_tokens, i), p.image_keys,
            p.images if self.encoder is None else [])),
            req.stop) for i in range(req.n)]
        try:
            return streams, list(await asyncio.gather(*(anext(s) for s in streams)))
        except BaseException:
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
            raise

    async def _events(self, gen: DeploymentResponseGenerator, stops: list[str]) -> AsyncIterator[TextDelta]:
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
            if not engine_done:
                gen.cancel()

    def _log(self, log: dict, choices: list[ChoiceState]) -> None:
        finish = ",".join(str(c.finish_reason) for c in choices)
        logger.info("%s prompt=%d images=%d completion=%d finish=%s ttft=%.0fms total=%.0fms", log["id"],
                    log["prompt"], log["images"], sum(len(c.token_ids) for c in choices), finish,
                    log["ttft"] * 1000, (time.monotonic() - log["started"]) * 1000)
