"""A prompt's generations, up to their first text deltas: its images and videos encoded (a video over the encoder's
batch in chunks of tubelets, one call each across the encoder replicas; those whose encoder replica went away
once more), its choices started on the LLM tier (all once more when their replica went away first), and each
choice's token chunks turned into text. Chat and text completions both start here."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray.serve.handle import DeploymentHandle, DeploymentResponse
from transformers import PreTrainedTokenizerBase

from deployments.ingress.channel import ROUTE_TIMEOUT_S, ChannelHub, TokenStream
from deployments.ingress.detokenize import TextDelta, TextRules
from deployments.ingress.items import Prepared
from schemas import (
    LLM_GONE,
    AppArgs,
    EncoderUnavailable,
    GenerateRequest,
    Overloaded,
    SamplingParams,
    observe,
    root_cause,
)

logger = logging.getLogger("ray.serve")

Started = tuple[list[AsyncIterator[TextDelta]], list[TextDelta]]  # each choice's deltas, and its first delta


class Generator:
    def __init__(
        self,
        encoder: DeploymentHandle | None,
        llm: DeploymentHandle,
        hub: ChannelHub,
        args: AppArgs,
        tokenizer: PreTrainedTokenizerBase,
    ):
        self.encoder, self.llm, self.hub, self.args, self.tokenizer = encoder, llm, hub, args, tokenizer
        self.counts = {"encoder_retries": 0, "encoder_failures": 0, "encoder_timeouts": 0, "llm_retries": 0}

    async def start(
        self, p: Prepared, params: list[SamplingParams], text: TextRules, request_id: str, first: int = 0
    ) -> Started:
        """Encode `p`'s images and start one generation per `params` (choices `first`, `first` + 1, ...), up to
        their first deltas, so that an early error still gets its own status."""
        if self.encoder is None or not p.images:  # colocated: the LLM replica gets the bytes and encodes them
            return await self._generate(p, params, text, [], request_id, first)
        calls: list[DeploymentResponse] = []
        try:
            return await self._encode_and_generate(p, params, text, request_id, first, calls)
        except BaseException:  # client gone, deadline, or an error: images still queued are not encoded
            for call in calls:
                call.cancel()
            raise

    async def start_all(
        self, prompts: list[Prepared], params: list[list[SamplingParams]], text: TextRules, request_id: str
    ) -> Started:
        """`start` for each prompt at once, its choices numbered after the earlier prompts'. If one fails (or the
        request ends), the others are cancelled and the streams already started closed, cancelling them."""
        if len(prompts) == 1:
            return await self.start(prompts[0], params[0], text, request_id)
        firsts = [sum(len(ps) for ps in params[:k]) for k in range(len(prompts))]
        tasks = [
            asyncio.ensure_future(self.start(p, ps, text, request_id, f))
            for p, ps, f in zip(prompts, params, firsts, strict=True)
        ]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            started = [t.result()[0] for t in tasks if not t.cancelled() and t.exception() is None]
            await asyncio.gather(*(s.aclose() for streams in started for s in streams), return_exceptions=True)
            raise
        return [s for r in results for s in r[0]], [d for r in results for d in r[1]]

    async def _encode(self, p: Prepared, indices: list[int], calls: list[DeploymentResponse]) -> list[Any]:
        """One encoder call per image (and per chunk of a video), concurrently, each naming its cost (the Encoder's
        router, encoder_router.py, spreads them by it); only ObjectRefs come back (the ingress never holds
        embeddings). The calls are added to `calls`, to be cancelled if the request ends early."""
        responses = [self.encoder.encode.remote(p.jobs[i], p.job_keys[i], cost=p.job_costs[i]) for i in indices]
        calls += responses
        refs = asyncio.gather(*(r._to_object_ref() for r in responses))
        refs.add_done_callback(observe)  # a request that ends early leaves it failing unobserved
        try:
            # NOTE: not wait_for, which on Python 3.11 returns the result of a future that completes as the task is
            # cancelled, dropping the cancellation: Serve cancels a request's calls (these) just before the request
            # itself when its client leaves, and the request went on to re-encode and generate for nobody.
            async with asyncio.timeout(self.args.encoder.timeout_s):
                return list(await refs)
        except TimeoutError:
            self.counts["encoder_timeouts"] += 1
            raise Overloaded("no encoder replica took the images in time", retry_after_s=2) from None

    async def _encode_and_generate(self, p, params, text, request_id, first, calls) -> Started:
        """The generations start as soon as every image is on an encoder replica: the LLM fetches each embedding as
        it is made and prefills up to the first not there yet (llm/images.py). An image lost on the way (its replica
        went away) fails the generations; it is encoded once more, each image at most once more."""
        refs, retried = await self._encode(p, list(range(len(p.jobs))), calls), set()
        while True:
            try:
                return await self._generate(p, params, text, refs, request_id, first)
            except Exception as e:
                cause = root_cause(e)
                if not isinstance(cause, EncoderUnavailable):
                    raise
                if retried & set(cause.image_indices):  # NOTE: one image at a time now, as each arrives or fails
                    self.counts["encoder_failures"] += 1
                    raise Overloaded(
                        "image encoding failed twice; the encoder tier is recovering", retry_after_s=2
                    ) from e
                logger.warning("%s: %s; retrying them once", request_id, cause.message)
                retried |= set(cause.image_indices)
                self.counts["encoder_retries"] += len(cause.image_indices)
                for i, ref in zip(cause.image_indices, await self._encode(p, cause.image_indices, calls), strict=True):
                    refs[i] = ref

    async def _generate(
        self, p: Prepared, params: list[SamplingParams], text: TextRules, refs: list[Any], request_id: str, first: int
    ) -> Started:
        """The generations, up to their first chunks. Each attempt waits at most ROUTE_TIMEOUT_S for an LLM replica
        to take each, else 503 (none alive); an LLM replica lost before the first chunks (its call or its token channel
        says so first, schemas.LLM_GONE): all once more (Serve's router routes around a dead replica)."""
        channel = self.hub.id if self.args.llm.token_channel else None
        requests = [
            GenerateRequest(
                f"{request_id}-{first + i}",
                p.prompt,
                p.grids,
                refs,
                sampling,
                p.image_keys,
                p.images if self.encoder is None else [],
                p.routing_key or None,
                channel,
                p.cache_scope,
                p.second_per_grid_ts if p.num_videos else [],
                p.jobs_per_item if len(p.jobs) > len(p.images) else [],
                p.num_tokens,
            )
            for i, sampling in enumerate(params)
        ]
        for attempt in (1, 2):
            call = self.llm.options(stream=True).generate.remote
            streams = [
                self._events(TokenStream(self.hub, call(r), r.request_id, ROUTE_TIMEOUT_S), text) for r in requests
            ]
            try:
                return streams, list(await asyncio.gather(*(anext(s) for s in streams)))
            except BaseException as e:
                await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
                if attempt == 2 or not isinstance(root_cause(e), LLM_GONE):
                    raise
                logger.warning("%s: its LLM replica went away before the first token (%r); once more", request_id, e)
                self.counts["llm_retries"] += 1
        raise AssertionError("unreachable")

    async def _events(self, gen: TokenStream, text: TextRules) -> AsyncIterator[TextDelta]:
        """One choice's token chunks -> text deltas; a stop string ends it (and cancels its generation)."""
        out, engine_done = text.processor(self.tokenizer), False
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


__all__ = ["Generator", "Started"]
