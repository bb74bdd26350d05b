"""A prompt's generations, up to their first text deltas: its images and videos encoded (those in the embedding cache
not again; the others in calls of at most one ViT forward each, across the encoder replicas; a video over the
encoder's batch in chunks of tubelets; those whose encoder replica went away once more), its choices started on the
LLM tier (all once more when their replica went away first), and each choice's token chunks turned into text. Chat
and text completions both start here."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from ray.serve.handle import DeploymentHandle, DeploymentResponse
from transformers import PreTrainedTokenizerBase

from deployments.channel import ROUTE_TIMEOUT_S, ChannelHub, TokenStream
from deployments.errors import LLM_GONE, root_cause
from deployments.ingress.detokenize import OutputProcessor
from deployments.ingress.prepare import Prepared
from deployments.metrics import IngressMetrics
from deployments.ray_private import object_ref
from schemas import (
    AppArgs,
    EncoderUnavailable,
    GenerateRequest,
    MediaItem,
    Overloaded,
    SamplingParams,
    TokenChunk,
    observe,
)

logger = logging.getLogger("ray.serve")

Started = tuple[list[AsyncIterator[TokenChunk]], list[TokenChunk]]  # each choice's text deltas, and its first
Job = tuple[int, int]  # (item, job): a prompt's item's encoder job (an image, or a chunk of a video)
Ref = Any  # a ray.ObjectRef (anything hashable in tests)


class Generator:
    def __init__(
        self,
        encoder: DeploymentHandle | None,
        llm: DeploymentHandle,
        hub: ChannelHub,
        args: AppArgs,
        tokenizer: PreTrainedTokenizerBase,
        *,
        embedding_row_bytes: int = 0,
        metrics: IngressMetrics | None = None,
    ):
        """`encoder`: the Encoder deployment's handle, None when the LLM replica encodes (colocated);
        `embedding_row_bytes`: what one row of an embedding counts against the embedding cache's budget."""
        self.encoder, self.llm, self.hub, self.args, self.tokenizer = encoder, llm, hub, args, tokenizer
        self.counts = {"encoder_retries": 0, "encoder_failures": 0, "encoder_timeouts": 0, "llm_retries": 0}
        budget = int(args.encoder.cache_gib * (1 << 30))
        self.cache = EmbeddingRefs(budget) if encoder is not None and budget > 0 else None
        self.row_bytes, self.metrics = embedding_row_bytes, metrics

    async def start(self, p: Prepared, params: list[SamplingParams], request_id: str, first: int = 0) -> Started:
        """Encode `p`'s images and start one generation per `params` (choices `first`, `first` + 1, ...), up to
        their first deltas, so that an early error still gets its own status."""
        if self.encoder is None or not p.items:  # colocated: the LLM replica gets the bytes and encodes them
            media = [item.data for item in p.items]
            return await self._generate(p, params, [item.for_engine() for item in p.items], media, request_id, first)
        calls: list[DeploymentResponse] = []
        made: list[Any] = []  # the refs of this request's own calls
        try:
            return await self._encode_and_generate(p, params, request_id, first, calls, made)
        except BaseException:  # client gone, deadline, or an error: images still queued are not encoded
            for call in calls:
                call.cancel()
            if self.cache is not None:  # what they hold may be a cancellation, or an error: not for later requests
                self.cache.discard(made)
            raise

    async def start_all(self, prompts: list[Prepared], params: list[list[SamplingParams]], request_id: str) -> Started:
        """`start` for each prompt at once, its choices numbered after the earlier prompts'. If one fails (or the
        request ends), the others are cancelled and the streams already started closed, cancelling them."""
        if len(prompts) == 1:
            return await self.start(prompts[0], params[0], request_id)
        firsts = [sum(len(ps) for ps in params[:k]) for k in range(len(prompts))]
        tasks = [
            asyncio.ensure_future(self.start(p, ps, request_id, f))
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

    async def _locate(
        self, p: Prepared, jobs: list[Job], calls: list[DeploymentResponse], made: list[Any]
    ) -> dict[Job, tuple[Any, int]]:
        """Where each job's embedding is: (the ObjectRef of an encoder call, its position in what the call
        returns). Found in the cache, or encoded: the misses, in prompt order, in calls of at most one ViT
        forward's patches (encoder.max_batch_patches; a bigger job alone), concurrently, each naming its cost (the
        Encoder's router, deployments/encoder/router.py, spreads them by it). Only ObjectRefs come back (the ingress
        never holds embeddings). The calls are added to `calls` (cancelled if the request ends early), their refs to
        `made`."""
        where: dict[Job, tuple[Any, int]] = {}
        misses = []
        for i, j in jobs:
            hit = self.cache.get(p.items[i].jobs[j].key) if self.cache is not None else None
            if hit is not None:
                where[(i, j)] = hit
            else:
                misses.append((i, j))
        if self.cache is not None and self.metrics is not None:
            self.metrics.cache_queries.inc(len(jobs))
            if len(where):  # NOTE: Ray counters refuse inc(0)
                self.metrics.cache_hits.inc(len(where))
        groups = _pack([(job, p.items[job[0]].jobs[job[1]]) for job in misses], self.args.encoder.max_batch_patches)
        if not groups:
            return where
        responses = [
            self.encoder.encode.remote([job.data for _, job in group], cost=sum(job.cost for _, job in group))
            for group in groups
        ]
        calls += responses
        refs = asyncio.gather(*(object_ref(r) for r in responses))
        refs.add_done_callback(observe)  # a request that ends early leaves it failing unobserved
        try:
            # NOTE: not wait_for, which on Python 3.11 returns the result of a future that completes as the task is
            # cancelled, dropping the cancellation: Serve cancels a request's calls (these) just before the request
            # itself when its client leaves, and the request went on to re-encode and generate for nobody.
            async with asyncio.timeout(self.args.encoder.timeout_s):
                got = await refs
        except TimeoutError:
            self.counts["encoder_timeouts"] += 1
            raise Overloaded("no encoder replica took the images in time", retry_after_s=2) from None
        made += got
        for group, ref in zip(groups, got, strict=True):
            for position, (at, _) in enumerate(group):
                where[at] = (ref, position)
            if self.cache is not None:
                rows = sum(job.num_tokens for _, job in group)
                self.cache.put([job.key for _, job in group], ref, rows * self.row_bytes)
        return where

    async def _encode_and_generate(self, p, params, request_id, first, calls, made) -> Started:
        """The generations start as soon as every image is on an encoder replica (or in the cache): the LLM fetches
        each embedding as it is made and prefills up to the first not there yet (deployments/llm/server.py,
        `ImageArrivals`). An image lost on the way (its replica went away) fails the generations; it is encoded once
        more, each image at most once more."""
        jobs = [(i, j) for i, item in enumerate(p.items) for j in range(len(item.jobs))]
        where, retried = await self._locate(p, jobs, calls, made), set()
        while True:
            items, refs = _layout(p, where)
            try:
                return await self._generate(p, params, items, refs, request_id, first)
            except Exception as e:
                cause = root_cause(e)
                if not isinstance(cause, EncoderUnavailable):
                    raise
                gone = {refs[c] for c in cause.calls}
                lost = [job for job, (ref, _) in where.items() if ref in gone]
                if self.cache is not None:
                    self.cache.discard(gone)
                if retried & set(lost):  # NOTE: one call at a time, as each arrives or fails
                    self.counts["encoder_failures"] += 1
                    raise Overloaded(
                        "image encoding failed twice; the encoder tier is recovering", retry_after_s=2
                    ) from e
                images = sorted(i for i, _ in lost)  # a video's: once per chunk lost
                logger.warning("%s: %s; encoding images %s once more", request_id, cause.message, images)
                retried |= set(lost)
                self.counts["encoder_retries"] += len(lost)
                where |= await self._locate(p, lost, calls, made)

    async def _generate(
        self,
        p: Prepared,
        params: list[SamplingParams],
        items: list[MediaItem],
        media: list[Any],
        request_id: str,
        first: int,
    ) -> Started:
        """The generations, up to their first chunks. Each attempt waits at most ROUTE_TIMEOUT_S for an LLM replica
        to take each, else 503 (none alive); an LLM replica lost before the first chunks (its call or its token channel
        says so first, LLM_GONE): all once more (Serve's router routes around a dead replica). `media`: the
        encoder calls' ObjectRefs (`items`' pieces point into them), or colocated, each item's bytes."""
        channel = self.hub.id if self.args.llm.token_channel else None
        requests = [
            GenerateRequest(
                request_id=f"{request_id}-{first + i}",
                prompt_token_ids=p.prompt,
                sampling=sampling,
                items=items,
                routing_key=p.routing_key or None,
                channel=channel,
                cache_scope=p.cache_scope,
            )
            for i, sampling in enumerate(params)
        ]
        for attempt in (1, 2):
            call = self.llm.options(stream=True).generate.remote
            streams = [
                self._events(TokenStream(self.hub, call(r, media), r.request_id, ROUTE_TIMEOUT_S), r.sampling)
                for r in requests
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

    async def _events(self, gen: TokenStream, params: SamplingParams) -> AsyncIterator[TokenChunk]:
        """One choice's token chunks -> text deltas; a stop string ends it (and cancels its generation)."""
        out, engine_done = OutputProcessor(self.tokenizer, params), False
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


def _layout(p: Prepared, where: dict[Job, tuple[Any, int]]) -> tuple[list[MediaItem], list[Any]]:
    """What the LLM is sent: each item's record with its pieces, (call, position) per job, and the calls' ObjectRefs,
    each once (a call that holds several of the prompt's images, or one found in the cache for several)."""
    refs = list(dict.fromkeys(where[(i, j)][0] for i, item in enumerate(p.items) for j in range(len(item.jobs))))
    index = {ref: c for c, ref in enumerate(refs)}
    items = []
    for i, item in enumerate(p.items):
        pieces = tuple((index[where[(i, j)][0]], where[(i, j)][1]) for j in range(len(item.jobs)))
        items.append(item.for_engine(pieces))
    return items, refs


def _pack(jobs: list[tuple[Job, MediaItem]], max_patches: int) -> list[list[tuple[Job, MediaItem]]]:
    """Jobs, in order, into calls of at most `max_patches` patches each (one bigger alone): what one ViT forward
    of the Encoder's batcher takes, so that a call is one forward's worth and costs one call's overhead."""
    groups: list[list[tuple[Job, MediaItem]]] = []
    patches = 0
    for pair in jobs:
        if not groups or patches + pair[1].patches > max_patches:
            groups.append([])
            patches = 0
        groups[-1].append(pair)
        patches += pair[1].patches
    return groups


@dataclass(slots=True)
class _Object:
    nbytes: int
    entries: int = 0


class EmbeddingRefs:
    """LRU by bytes of (ref, position) by key. Not thread-safe: the ingress's event loop is its one user.

    The embedding cache of the encoder tier: by content key, the ObjectRefs of embeddings the Encoder replicas made,
    held by the ingress replica that asked for them (and owns them). The embeddings stay where Ray put them (the object
    store of the node that encoded them, or under Ray's inline limit in this process's store); a hit costs a dict
    lookup here and no call anywhere: the ref goes to the LLM as a fresh one would. It sits where the key is known,
    so no image's path crosses a shared process (the shared EmbeddingCache replica it replaces was one hop and one copy
    per image, and capped the whole tier).

    An entry is one job's place in what one encoder call returned (a call returns a list: the request's images, as many
    as one ViT forward takes). The call's object lives while any of its entries is here, and counts whole against the
    budget. Bytes are counted at 4 a value (float32): the ingress does not know the encoders' dtype, so a bfloat16 tier
    holds at most the budget and perhaps half of what it could. Each ingress replica has its own: a conversation whose
    turns reach another ingress replica misses once there.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes, self.nbytes = max_bytes, 0
        self._entries: OrderedDict[str, tuple[Ref, int]] = OrderedDict()
        self._objects: dict[Ref, _Object] = {}
        self.hits = self.misses = self.evictions = 0

    def get(self, key: str) -> tuple[Ref, int] | None:
        """(the call's ref, the job's position in what it returned), or None."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, keys: list[str], ref: Ref, nbytes: int) -> None:
        """What one call returned: `keys[i]` is the job at position i; `nbytes`, the whole object's. A call bigger
        than the budget is not kept; a key already here keeps its entry."""
        if nbytes > self.max_bytes or ref in self._objects:
            return
        new = [(i, key) for i, key in enumerate(keys) if key not in self._entries]
        if not new:
            return
        obj = self._objects[ref] = _Object(nbytes)
        self.nbytes += nbytes
        for i, key in new:
            self._entries[key] = (ref, i)
            obj.entries += 1
        while self.nbytes > self.max_bytes:
            key, _ = next(iter(self._entries.items()))
            self._remove(key)
            self.evictions += 1

    def discard(self, refs: Iterable[Ref]) -> None:
        """Forget every entry in these calls' results (they failed, were cancelled, or their replica is gone)."""
        gone = {ref for ref in refs if ref in self._objects}
        if gone:
            for key in [k for k, (ref, _) in self._entries.items() if ref in gone]:
                self._remove(key)

    def _remove(self, key: str) -> None:
        ref, _ = self._entries.pop(key)
        obj = self._objects[ref]
        obj.entries -= 1
        if obj.entries == 0:  # the last entry of the call: its object goes (when the LLM holds it no more)
            del self._objects[ref]
            self.nbytes -= obj.nbytes

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "entries": len(self._entries),
            "objects": len(self._objects),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
        }


__all__ = ["EmbeddingRefs", "Generator", "Started"]
