"""LLM deployment: token ids + ObjectRefs of image embeddings in, a stream of TokenChunks out.

A request's images arrive as ObjectRefs (one per encoder call, each the list of the embeddings that call made): they
are fetched here, one future per image or video (`ImageArrivals`), so that the engine's prefill can run up to the
first one not here yet."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray
import torch
from ray import serve
from ray.exceptions import TaskCancelledError
from ray.serve.config import RequestRouterConfig
from transformers import AutoTokenizer

from deployments.channel import Batch, ChannelOpen, Outbox, Routed
from deployments.errors import REPLICA_GONE, quiet_client_errors, root_cause
from deployments.llm.router import PrefixAffinityRouter
from deployments.llm.tp import COLLECTIVE_TIMEOUT_S, Ranks
from deployments.metrics import EncoderMetrics, LLMMetrics, heap_census
from deployments.replica import DRAIN_POLL_S, this_replica
from encoders import EmbeddingLRU, EncoderRunner, ModelSpec
from llm import Engine, EngineConfig, Qwen2LM, TextConfig, num_kv_blocks
from llm.model.parallel import ParallelLM, TPGroup, init_process_group
from schemas import (
    AppArgs,
    EncoderUnavailable,
    GenerateRequest,
    InvalidRequest,
    MediaItem,
    Overloaded,
    TokenChunk,
    observe,
)

logger = logging.getLogger("ray.serve")
# Errors the ingress answers (4xx, or a retry / 503) and that are no fault of this replica: sent down the stream as
# an item, not raised, so that Serve does not log each as a failed request with a traceback.
_ANSWERED = (InvalidRequest, EncoderUnavailable, Overloaded)
# Errors that mean "the encoder replica (or its node) went away", not "this image is bad".
_ENCODER_GONE = (*REPLICA_GONE, TaskCancelledError)


def bad_image(index: int, e: InvalidRequest) -> InvalidRequest:
    """An image the encoder could not read is the client's error; say which one."""
    return InvalidRequest(f"image {index}: {e.message}", param="messages")


def check_refs(refs: list[Any]) -> None:
    for ref in refs:  # invariant: the ingress passes references, never embeddings
        if not isinstance(ref, ray.ObjectRef):
            raise TypeError(f"image embeddings must arrive as ObjectRefs, got {type(ref).__name__}")


async def _fetch_call(ref: ray.ObjectRef, call: int, timeout_s: float) -> list[torch.Tensor | InvalidRequest]:
    """What encoder call `call` returned. EncoderUnavailable when its replica went away or it did not come in
    `timeout_s`: the ingress encodes its images once more, on another replica."""
    try:
        async with asyncio.timeout(timeout_s):
            return await ref
    except TimeoutError:
        raise EncoderUnavailable(f"encoder call {call} did not answer in {timeout_s:g} s", [call]) from None
    except Exception as e:
        cause = root_cause(e)
        if isinstance(cause, _ENCODER_GONE):
            raise EncoderUnavailable(f"encoder call {call} was lost ({type(cause).__name__})", [call]) from None
        if isinstance(cause, InvalidRequest):
            raise cause from None
        raise


async def _item(index: int, item: MediaItem, calls: list[asyncio.Future]) -> torch.Tensor:
    pieces = []
    try:
        for call, position in item.pieces:
            out = (await calls[call])[position]  # a tensor, or the client's error with this image
            if isinstance(out, BaseException):
                raise out
            pieces.append(out)
    except InvalidRequest as e:
        raise bad_image(index, e) from None
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # a video's chunks, in order, are its embedding


class ImageArrivals:
    """One future per image or video (`items`), done with its (num_tokens, D) embedding, or failed: EncoderUnavailable
    naming the encoder calls lost, or the client's InvalidRequest naming the image. Each encoder call is fetched
    once, whatever the number of items it holds. `cancel` when the generation ends."""

    def __init__(self, items: list[MediaItem], refs: list[Any], timeout_s: float):
        check_refs(refs)  # here, before the generation starts
        self.calls = [asyncio.ensure_future(_fetch_call(ref, c, timeout_s)) for c, ref in enumerate(refs)]
        for call in self.calls:  # one that no item awaits any more (an earlier piece failed) fails unobserved
            call.add_done_callback(observe)
        self.items = [asyncio.ensure_future(_item(i, item, self.calls)) for i, item in enumerate(items)]

    def cancel(self) -> None:
        """Nothing of the request's images is waited for any more."""
        for future in self.items + self.calls:
            future.cancel()
            future.add_done_callback(observe)


def reserved_cpus() -> int:
    """The CPUs Ray reserved for this replica (its `num_cpus`), at least one: Ray's own rule for OMP_NUM_THREADS.

    NOTE: the engine's threads spin between ops; more of them than the replica reserved take cores from the
    encoders and the ingress on the same node (on 2 cores, 2 engine threads made the served app 40% slower).
    """
    if not ray.is_initialized():  # not in a Ray worker; and asking the runtime context would start (or join!) one
        return max(1, os.cpu_count() or 1)
    try:
        return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
    except AssertionError:  # Ray's "only available when the process is a worker": a driver
        return max(1, os.cpu_count() or 1)


# NOTE: the router is set here, not in serve_config.yaml: `serve deploy` imports a class path named in the YAML on
# the client, where `deployments` is not importable; the YAML can still override its kwargs.
@serve.deployment(
    name="LLM",
    ray_actor_options={"num_cpus": 1},
    max_ongoing_requests=256,
    request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter),
    graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
)
class LLM:
    def __init__(self, args: dict[str, Any], model_factory: Callable[..., Qwen2LM] | None = None):
        self.args = AppArgs.model_validate(args)
        quiet_client_errors()  # e.g. a bad image found while its request is in the engine
        self.spec = spec = ModelSpec.from_args(self.args)  # the checkpoint's facts, read once in this replica
        device, dtype = spec.device, spec.dtype
        llm_args = self.args.llm
        cpu_threads = cpu_threads_max = None
        if device == "cpu":  # NOTE: one thread process-wide; the cores go to the engine's worker (engine/threads.py)
            cpu_threads = llm_args.cpu_threads or reserved_cpus()
            cpu_threads_max = llm_args.cpu_threads_max  # above cpu_threads: follow the node's load up to it
            torch.set_num_threads(1)
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("device is cuda but this LLM replica has no GPU: set its ray_actor_options num_gpus: 1")
        self.ranks: Ranks | None = None
        if (tp := llm_args.tensor_parallel_size) > 1:
            model = self._start_ranks(tp, device, dtype)
        elif model_factory is not None:
            model = model_factory(self.args.model, device=device, dtype=dtype)
        else:
            model = Qwen2LM.from_pretrained(
                self.args.model, device=device, dtype=dtype, config=TextConfig.from_hf(spec.hf_config)
            )
        max_model_len = spec.max_model_len
        num_blocks = num_kv_blocks(
            model.kv_bytes_per_token(),
            block_size=llm_args.block_size,
            max_model_len=max_model_len,
            device=torch.device(device),
            kv_cache_tokens=llm_args.kv_cache_tokens,
            gpu_memory_utilization=llm_args.gpu_memory_utilization,
            cpu_kv_cache_gib=llm_args.cpu_kv_cache_gib,
        )
        # named the same in llm.* and in EngineConfig
        same = ("block_size", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "cuda_graphs")
        same += ("compile_decode", "async_decode", "cpu_packed_weights", "cpu_helper_thread", "cpu_threads_max_rows")
        engine_config = EngineConfig(
            max_model_len=max_model_len,
            num_blocks=num_blocks,
            max_queued=llm_args.max_queued_requests,
            stream_interval_s=llm_args.stream_interval_ms / 1000,
            cpu_threads=cpu_threads,
            cpu_threads_max=cpu_threads_max,
            **{name: getattr(llm_args, name) for name in same},
        )
        self.engine = Engine(
            model,
            engine_config,
            image_token_id=spec.image_tokens.placeholder_id,
            merge_size=spec.merge_size,
            eos_token_ids=spec.eos_token_ids,
            load_tokenizer=lambda: AutoTokenizer.from_pretrained(self.args.model, config=spec.hf_config),
            video_token_id=spec.image_tokens.video_placeholder_id,
            tokens_per_second=getattr(getattr(spec.hf_config, "vision_config", None), "tokens_per_second", None),
        )
        self.metrics = LLMMetrics(self.engine.stats, self.engine.drain_timings)
        self.replica_id = this_replica() if llm_args.token_channel else None  # None: own streams only, no channels
        self.channels: dict[str, Outbox] = {}  # ingress id -> its open channel here (deployments/channel.py)
        # Messages sent back to ingress replicas: chunks on generations' own streams, and channel messages
        self.sent = {"stream_messages": 0, "channel_messages": 0, "channel_generations": 0, "channels_opened": 0}
        self._metrics_task: asyncio.Task | None = None
        self.vision = self.vision_cache = None
        if self.args.encoder.colocated:  # the encoder lives here, sharing this replica's device with the engine
            self.vision = EncoderRunner(
                spec, self.args.encoder, on_batch=EncoderMetrics().on_batch, video=self.args.video
            )
            self.vision_cache = EmbeddingLRU(int(self.args.encoder.cache_gib * (1 << 30)))
        logger.info(
            "llm ready: %s on %s (%s, %s engine threads, %d tensor-parallel ranks), context %d, KV cache %d "
            "tokens (%.2f GiB per rank)%s",
            self.args.model,
            device,
            dtype,
            f"{cpu_threads}-{cpu_threads_max}" if cpu_threads_max else cpu_threads or "default",
            llm_args.tensor_parallel_size,
            max_model_len,
            num_blocks * llm_args.block_size,
            self.engine.runner.cache.nbytes / (1 << 30),
            ", encoder colocated" if self.vision else "",
        )

    def _start_ranks(self, world_size: int, device: str, dtype: torch.dtype) -> ParallelLM:
        """This replica is rank 0 of `world_size`; the others are actors in its placement group (tp.py)."""
        group, shard = TPGroup(0, world_size), []

        def join(init_method: str) -> None:
            init_process_group(
                0,
                world_size,
                init_method,
                torch.device(device, 0) if device == "cuda" else torch.device("cpu"),
                COLLECTIVE_TIMEOUT_S,
            )
            shard.append(
                Qwen2LM.from_pretrained(
                    self.args.model,
                    device=device,
                    dtype=dtype,
                    tp=group,
                    config=TextConfig.from_hf(self.spec.hf_config),
                )
            )

        self.ranks = Ranks(world_size, device)
        self.ranks.start(self.args.model, device, str(dtype).removeprefix("torch."), self.args.llm.cpu_threads, join)
        return ParallelLM(shard[0])

    def check_health(self) -> None:
        """Serve restarts a replica whose engine stopped or whose tensor-parallel rank ended."""
        if self.engine.dead is not None:
            raise RuntimeError(f"the engine stopped: {self.engine.dead}")
        if self.ranks is not None:
            self.ranks.check()

    async def _encode_here(self, items: list[MediaItem], media: list[Any]) -> list[torch.Tensor]:
        """Colocated mode: encode the request's images (`media`: each item's bytes, or a Video) in this replica, a
        local cache by content key in place of the ingress's."""
        assert self.vision is not None and self.vision_cache is not None, "images as bytes need encoder.colocated"
        assert len(media) == len(items), (len(media), len(items))

        async def one(i: int, item: MediaItem, data: Any) -> torch.Tensor:
            if item.key and (hit := self.vision_cache.get(item.key)) is not None:
                return hit
            try:
                embeds = await self.vision.encode(data)
            except InvalidRequest as e:
                raise bad_image(i, e) from None
            if item.key:
                self.vision_cache.put(item.key, embeds)
            return embeds

        self.engine.encoding += 1  # the engine's CPU rule leaves the cores to the encoding meanwhile (engine.py)
        try:
            return list(await asyncio.gather(*(one(i, *pair) for i, pair in enumerate(zip(items, media)))))
        finally:
            self.engine.encoding -= 1

    async def stats(self) -> dict[str, float]:
        return {**self.engine.stats(), **self.sent, "channels_open": len(self.channels)}

    async def heap(self) -> dict[str, Any]:
        return heap_census()

    async def generate(
        self, request: GenerateRequest, media: list[Any] | None = None
    ) -> AsyncIterator[TokenChunk | Routed | Exception]:
        """The chunks of one generation; with `request.channel` a `Routed` first, and the chunks through that
        ingress's channel when it has one open here (deployments/channel.py). `media`: the ObjectRefs of the
        encoder calls that hold its items' embeddings (`MediaItem.pieces` says where), or colocated, each item's
        bytes. An error the ingress answers (`_ANSWERED`) is the stream's last item, with one log line here."""
        try:
            async for item in self._generate(request, media or []):
                yield item
        except _ANSWERED as e:
            level = logging.INFO if isinstance(e, InvalidRequest) else logging.WARNING
            logger.log(level, "%s: %s: %s", request.request_id, type(e).__name__, e)
            yield e

    async def _generate(self, request: GenerateRequest, media: list[Any]) -> AsyncIterator[TokenChunk | Routed]:
        if self._metrics_task is None:  # started on the replica's event loop, which __init__ may not run on
            self._metrics_task = asyncio.create_task(self.metrics.run())
        arrivals: ImageArrivals | None = None
        if not request.items:
            embeds = []
        elif self.vision is not None:
            embeds = await self._encode_here(request.items, media)
        else:
            arrivals = ImageArrivals(request.items, media, self.args.encoder.timeout_s)
            # futures: prefill overlaps encoding; else all of them first
            embeds = arrivals.items if self.args.llm.overlap_encoding else await asyncio.gather(*arrivals.items)
        try:
            async for item in self._submit(request, embeds):
                yield item
        finally:  # the generation ended: images still being fetched are not waited for
            if arrivals is not None:
                arrivals.cancel()

    async def _submit(self, request: GenerateRequest, embeds: list[Any]) -> AsyncIterator[TokenChunk | Routed]:
        if (grammar := request.sampling.grammar) is not None:  # compiled off the event loop; `submit` finds it cached
            await asyncio.to_thread(self.engine.grammars.compile, grammar)
        box = self.channels.get(request.channel) if request.channel and self.replica_id else None
        if box is None:
            if request.channel and self.replica_id:
                yield Routed(self.replica_id, via_channel=False)
            async for chunk in self.engine.generate(request, embeds):
                self.sent["stream_messages"] += 1
                yield chunk
            return
        done, sink = box.attach(request.request_id)  # attached before any await: the channel cannot close between
        try:
            seq = self.engine.submit(request, sink, embeds)
        except BaseException:
            box.detach(request.request_id)
            raise
        self.sent["channel_generations"] += 1
        try:
            yield Routed(self.replica_id, via_channel=True)
            await done  # the chunks go out through the channel; this call ends when the last one has
        finally:
            box.detach(request.request_id)
            self.engine.cancel(seq)

    async def channel(self, req: ChannelOpen) -> AsyncIterator[Batch]:
        """One ingress's token channel: each step's chunks of all its generations here, as one message."""
        if req.replica_id != self.replica_id:
            raise RuntimeError(f"a channel for LLM replica {req.replica_id} reached {self.replica_id}")
        llm_args = self.args.llm
        box = Outbox(self.replica_id, llm_args.stream_interval_ms / 1000, llm_args.token_channel_idle_s)
        self.channels[req.ingress_id] = box
        self.sent["channels_opened"] += 1
        try:
            async for batch in box.stream():
                self.sent["channel_messages"] += 1
                yield batch
        finally:
            if self.channels.get(req.ingress_id) is box:
                del self.channels[req.ingress_id]
