"""Ingress deployment: OpenAI-compatible HTTP; validates, tokenizes, fans images out, streams text back."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from transformers import AutoConfig

from deployments.http import error_body, error_response, parse, read_json, sse
from encoders import decode_data_url, family_of, probe_image
from llm import IncrementalDetokenizer, StopMatcher, build_prompt, load_tokenizer
from schemas import AppArgs, FinishReason, GenerateRequest, InvalidRequest, SamplingParams, resolve_max_model_len
from schemas.openai import (ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Choice, ChunkChoice, Delta,
                            ImagePart, ModelCard, ModelList, ResponseMessage, Usage)

logger = logging.getLogger("ray.serve")
Event = tuple[str, list[int], FinishReason | None]  # (new text, new token ids, finish reason)


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=256)
class Ingress:
    def __init__(self, encoder: DeploymentHandle, llm: DeploymentHandle, args: dict[str, Any]):
        self.encoder, self.llm = encoder, llm
        self.args = AppArgs.model_validate(args)
        config = AutoConfig.from_pretrained(self.args.model)
        self.image_token_id = config.image_token_id
        self.processing = family_of(self.args.model).processing.from_pretrained(self.args.model)
        self.tokenizer = load_tokenizer(self.args.model)
        self.max_model_len = resolve_max_model_len(
            self.args.llm.max_model_len, config.text_config.max_position_embeddings)
        self.routes = {"/v1/chat/completions": ("POST", self.chat), "/v1/models": ("GET", self.models),
                       "/health": ("GET", self.health)}

    async def __call__(self, request: Request) -> Response:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            path = request.url.path.removeprefix(request.scope.get("root_path", "")).rstrip("/")
            method, handler = self.routes.get(path, (None, None))
            if handler is None:
                raise InvalidRequest(f"no route {request.url.path}", status=404, code="not_found")
            if request.method != method:
                raise InvalidRequest(f"{request.url.path} takes {method}, not {request.method}", status=405)
            return await handler(request, request_id)
        except Exception as e:
            return error_response(e, request_id)

    async def health(self, request: Request, request_id: str) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request, request_id: str) -> Response:
        card = ModelCard(id=self.args.model_name, max_model_len=self.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    def _prepare(self, req: ChatCompletionRequest) -> tuple[list[int], list[bytes], list[tuple[int, int, int]], int]:
        """Checks, image headers, prompt ids: (prompt ids, image bytes, grids, max_tokens). CPU work, no pixels."""
        limits = self.args.limits
        if req.model is not None and req.model != self.args.model_name:
            raise InvalidRequest(f"model {req.model!r} is not served here; this server serves {self.args.model_name!r}",
                                 param="model", code="model_not_found", status=404)
        if len(req.stop) > limits.max_stop or any(len(s) > limits.max_stop_chars for s in req.stop):
            raise InvalidRequest(f"at most {limits.max_stop} stop strings of at most {limits.max_stop_chars} characters",
                                 param="stop")
        images, grids, counts = [], [], []
        for i, message in enumerate(req.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                if not isinstance(part, ImagePart):
                    continue
                param = f"messages[{i}].content[{j}].image_url"
                if len(images) == limits.max_images_per_request:
                    raise InvalidRequest(f"more than {limits.max_images_per_request} images in one request", param=param)
                try:
                    data = decode_data_url(part.image_url.url, limits.max_image_bytes)
                    info = probe_image(data, limits)
                except InvalidRequest as e:
                    raise InvalidRequest(f"{param}: {e.message}", param=param, code=e.code, status=e.status) from e
                images.append(data)
                grids.append(self.processing.grid_thw(info.width, info.height))
                counts.append(self.processing.num_image_tokens(info.width, info.height))
        prompt = build_prompt(self.tokenizer, req.messages, self.image_token_id, counts)
        room = self.max_model_len - len(prompt)
        max_tokens = req.requested_max_tokens or min(limits.default_max_tokens, room)
        if room < 1 or max_tokens > room:
            asked = f" + max_tokens {max_tokens}" if req.requested_max_tokens else ""
            raise InvalidRequest(f"{len(prompt)} prompt tokens{asked} exceed the context length of "
                                 f"{self.max_model_len}", param="messages", code="context_length_exceeded")
        return prompt, images, grids, max_tokens

    async def chat(self, request: Request, request_id: str) -> Response:
        started = time.monotonic()
        req = parse(ChatCompletionRequest, await read_json(request, self.args.limits.max_request_bytes))
        prompt, images, grids, max_tokens = await asyncio.to_thread(self._prepare, req)
        # Fan out one encoder call per image; keep only ObjectRefs (the ingress never holds embeddings).
        refs = await asyncio.gather(*(self.encoder.encode.remote(image)._to_object_ref() for image in images))
        sampling = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                  ignore_eos=req.ignore_eos)
        gen = self.llm.options(stream=True).generate.remote(
            GenerateRequest(request_id, prompt, grids, list(refs), sampling))
        events = self._events(gen, req.stop)
        log = {"id": request_id, "prompt": len(prompt), "images": len(images), "started": started}
        if req.stream:
            first = await anext(events)  # an error before the first token still gets its own status
            log["ttft"] = time.monotonic() - started
            return StreamingResponse(self._sse(req, request_id, prompt, first, events, log),
                                     media_type="text/event-stream")
        text, ids, finish = "", [], None
        async for new_text, new_ids, finish in events:
            text, ids = text + new_text, ids + new_ids
        self._log(log, len(ids), finish)
        choice = Choice(message=ResponseMessage(content=text), finish_reason=finish,
                        token_ids=ids if req.return_token_ids else None)
        body = ChatCompletion(id=request_id, model=self.args.model_name, choices=[choice],
                              usage=Usage(prompt_tokens=len(prompt), completion_tokens=len(ids),
                                          total_tokens=len(prompt) + len(ids)),
                              prompt_token_ids=prompt if req.return_token_ids else None)
        return JSONResponse(body.model_dump())

    async def _events(self, gen: DeploymentResponseGenerator, stops: list[str]) -> AsyncIterator[Event]:
        """Token chunks -> text deltas; a stop string ends the stream (and cancels generation)."""
        detok, stop = IncrementalDetokenizer(self.tokenizer), StopMatcher(stops)
        try:
            async for chunk in gen:
                text = stop.feed(detok.add(chunk.token_ids))
                if chunk.finish_reason is not None and not stop.stopped:
                    text += stop.feed(detok.flush())
                    text += stop.flush()
                finish = "stop" if stop.stopped else chunk.finish_reason
                yield text, chunk.token_ids, finish
                if finish is not None:
                    return
            raise RuntimeError("the generation stream ended without a finish reason")
        finally:
            gen.cancel()  # no-op when finished; frees the LLM's sequence when the client left or a stop hit

    async def _sse(self, req: ChatCompletionRequest, request_id: str, prompt: list[int], first: Event,
                   events: AsyncIterator[Event], log: dict) -> AsyncIterator[str]:
        head = {"id": request_id, "created": int(time.time()), "model": self.args.model_name}
        n_completion, finish = 0, None
        try:
            yield sse(ChatCompletionChunk(**head, choices=[ChunkChoice(delta=Delta(role="assistant", content=""))],
                                          prompt_token_ids=prompt if req.return_token_ids else None))
            event: Event | None = first
            while event is not None:
                text, ids, finish = event
                n_completion += len(ids)
                if text or (ids and req.return_token_ids):
                    choice = ChunkChoice(delta=Delta(content=text), token_ids=ids if req.return_token_ids else None)
                    yield sse(ChatCompletionChunk(**head, choices=[choice]))
                if finish is not None:
                    yield sse(ChatCompletionChunk(**head, choices=[ChunkChoice(delta=Delta(), finish_reason=finish)]))
                event = None if finish is not None else await anext(events, None)
            if req.stream_options is not None and req.stream_options.include_usage:
                usage = Usage(prompt_tokens=len(prompt), completion_tokens=n_completion,
                              total_tokens=len(prompt) + n_completion)
                yield sse(ChatCompletionChunk(**head, choices=[], usage=usage))
        except Exception as e:  # after the 200: the error goes out as an event, which OpenAI clients raise
            yield sse(error_body(e, request_id)[2])
        finally:
            await events.aclose()
            self._log(log, n_completion, finish)
        yield "data: [DONE]\n\n"

    def _log(self, log: dict, n_completion: int, finish: str | None) -> None:
        ttft = f" ttft={log['ttft'] * 1000:.0f}ms" if "ttft" in log else ""
        logger.info("%s prompt=%d images=%d completion=%d finish=%s%s total=%.0fms", log["id"], log["prompt"],
                    log["images"], n_completion, finish, ttft, (time.monotonic() - log["started"]) * 1000)
