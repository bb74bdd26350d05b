"""The generation engine: requests in, token chunks out, and the worker loop between them.

The async side (`submit`) takes a `GenerateRequest` with its image embeddings, checks it and makes its `Sequence`
(sequence.py), queues it (bounded), and hands its `TokenChunk`s to a sink on the caller's event loop: one callback per
step for all the sequences of that loop (the LLM deployment sends them on through a per-ingress channel,
deployments/channel.py). `generate` is a stream of one sequence's chunks on top of it, coalescing tokens that arrive
within `stream_interval_s`. The worker loops, one `run` per step: the scheduler picks the step (decodes + prefill chunks
+ admissions), the model runner builds its inputs (embeddings with the images merged in), runs the forward and samples,
the scheduler applies the stop rules, and the engine emits each sequence's new token. `cancel` (or closing a stream)
frees a sequence's blocks at the next step. An image's embeddings may be a future (still encoding): the sequence is
queued at once, its prefill runs up to the first image not arrived, and each arrives through the inbox in any order; one
that fails fails its sequence with the future's error.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from llm.engine.block_pool import BlockPool
from llm.engine.grammar import Grammars, OffGrammar
from llm.engine.model_runner import Launched, ModelRunner, Sampled
from llm.engine.scheduler import Chunk, Scheduler
from llm.engine.sequence import Sequence, make_sequence
from llm.engine.threads import StepThreads
from llm.model import cpu_kernels
from llm.model.parallel import RankFailure
from schemas import GenerateRequest, InvalidRequest, Overloaded, TokenChunk

if TYPE_CHECKING:
    from llm.model import Qwen2LM

logger = logging.getLogger(__name__)


Sink = Callable[[TokenChunk | BaseException], None]
_Delivered = tuple[Sequence, Sink, TokenChunk | BaseException]


class Delivery:
    """Each live stream's event loop and sink, by seq_id: `attach` adds, `detach` removes (on the event loop). The
    worker `emit`s a step's items, collected per loop, and `flush`es them: one callback per loop, not one per
    sequence and token."""

    def __init__(self) -> None:
        self._sinks: dict[int, tuple[asyncio.AbstractEventLoop, Sink]] = {}
        self._pending: dict[asyncio.AbstractEventLoop, list[_Delivered]] = {}

    def attach(self, seq: Sequence, loop: asyncio.AbstractEventLoop, sink: Sink) -> None:
        self._sinks[seq.seq_id] = (loop, sink)

    def detach(self, seq: Sequence) -> None:
        self._sinks.pop(seq.seq_id, None)

    def emit(self, seq: Sequence, item: TokenChunk | BaseException) -> None:
        if (entry := self._sinks.get(seq.seq_id)) is not None:  # None: its stream has ended, nobody listens
            self._pending.setdefault(entry[0], []).append((seq, entry[1], item))

    def drop(self) -> None:
        """Forget what was emitted since the last flush (a failed step's tokens: its error goes out instead)."""
        self._pending.clear()

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for loop, items in pending.items():
            try:
                loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # the event loop is gone: nobody is listening
                for seq, _, _ in items:
                    seq.cancelled.set()

    def _deliver(self, items: list[_Delivered]) -> None:
        for seq, sink, item in items:  # on the event loop: a stream cancelled since the step gets nothing more
            if (entry := self._sinks.get(seq.seq_id)) is not None and entry[1] is sink:
                sink(item)


@dataclass(slots=True)
class Arrival:
    """An image's embeddings (or the error that ended its encoding), for a sequence that waits for them."""

    seq: Sequence
    index: int
    embeds: torch.Tensor | BaseException


def _on_arrival(seq: Sequence, index: int, put: Callable[[Arrival], None]) -> Callable[[asyncio.Future], None]:
    """A done-callback (on the event loop) that hands the worker what the future holds. A cancelled future: the
    generation ended, and its sequence with it."""

    def done(future: asyncio.Future) -> None:
        if not future.cancelled():
            put(Arrival(seq, index, future.exception() or future.result()))

    return done


@dataclass(slots=True)
class EngineConfig:
    """The engine's settings (the LLM deployment fills them from `llm.*`, schemas/config.py)."""

    max_model_len: int
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_queued: int = 64
    enable_prefix_caching: bool = True
    stream_interval_s: float = 0.02
    cpu_threads: int | None = None  # CPU: torch threads of the worker thread alone (threads.py); None: leave as is
    cpu_threads_max: int | None = None  # above cpu_threads: the worker takes up to this many while the node is idle
    cpu_threads_max_rows: int = 256  # ...for steps of at least this many rows (prefill chunks); smaller on cpu_threads
    static_decode: bool | None = None  # decode-only steps through decode_step.py; None: on cuda with one rank
    cuda_graphs: bool | None = None  # replay them as CUDA graphs; None: on cuda with one rank
    compile_decode: bool = False  # the static step through torch.compile (decode_step.py)
    async_decode: bool | None = None  # launch a static step before the last one's tokens are in; None: on cuda
    cpu_packed_weights: bool = True  # CPU, one rank: GEMMs on packed copies, ours or oneDNN's (layers.pack_linears)
    cpu_helper_thread: bool = True  # CPU, one rank, 2+ CPUs: decode attention and GEMMs share tasks with a helper

    def __post_init__(self) -> None:
        assert self.num_blocks * self.block_size >= self.max_model_len, "the cache must hold one full sequence"


class StepTrace:
    """A per-step trace for diagnosis: with VLM_STEP_TRACE=<path> in a replica's environment, the engine appends one
    line per step to <path>.<pid>: its start (time.monotonic, s), its duration (ms), its decode rows, its prefill
    tokens, the worker's torch threads, and the helper thread's counts so far (offered calls, tasks it computed, tasks
    taken over from it: cpu_kernels.helper_stats). Where a served step's time goes (a step against the gaps between
    steps, a prefill beside the decodes, the helper's share) is then a matter of reading the file; off (the default)
    it costs one `is None` a step."""

    def __init__(self, path: str) -> None:
        self.file = open(f"{path}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115 (lines: a killed replica loses none)

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get("VLM_STEP_TRACE")
        return cls(path) if path else None

    def record(self, started: float, chunks: list) -> None:
        ms = (time.monotonic() - started) * 1e3
        decode = sum(c.n == 1 for c in chunks)
        prefill = sum(c.n for c in chunks if c.n != 1)
        helper = " ".join(map(str, cpu_kernels.helper_stats())) if cpu_kernels.available() else "- - -"
        self.file.write(f"{started:.4f} {ms:.2f} {decode} {prefill} {torch.get_num_threads()} {helper}\n")


class Engine:
    def __init__(
        self,
        model: Qwen2LM,
        config: EngineConfig,
        *,
        image_token_id: int,
        merge_size: int,
        eos_token_ids: set[int],
        load_tokenizer: Callable[[], Any] | None = None,  # for structured outputs; None: grammars are refused
        video_token_id: int | None = None,
        tokens_per_second: float | None = None,  # Qwen2.5-VL's vision config's: videos' temporal positions
    ):
        self.model, self.config = model, config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.grammars = Grammars(load_tokenizer, model.config.vocab_size, self.eos_token_ids)
        self.runner = ModelRunner(
            model, config.num_blocks, config.block_size, max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len, max_num_batched_tokens=config.max_num_batched_tokens,
            static_decode=config.static_decode, cuda_graphs=config.cuda_graphs, compile_decode=config.compile_decode,
            packed_weights=config.cpu_packed_weights, helper_thread=config.cpu_helper_thread,
            decode_threads=config.cpu_threads,
        )  # fmt: skip
        # make_sequence's settings: context, decoder config (positions, vocabulary), where images and videos are
        self._sequence_kwargs = dict(
            max_model_len=config.max_model_len, lm_config=model.config, device=self.runner.device,
            image_token_id=image_token_id, merge_size=merge_size, video_token_id=video_token_id,
            tokens_per_second=tokens_per_second,
        )  # fmt: skip
        self.pool = BlockPool(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens)
        # written by the worker only
        self.counts = dict(
            finished=0, failed=0, steps=0, ahead_steps=0, cpu_threads=config.cpu_threads or 0, cpu_thread_changes=0,
            step_cpu_s=0.0, prefill_step_s=0.0,
        )  # fmt: skip
        # A decode step whose next one is launched before its tokens reach the host (vLLM's asynchronous scheduling,
        # for decode-only steps of plain rows): the host's work between two steps overlaps the device's.
        auto = self.runner.device.type == "cuda"
        self.ahead = self.runner.static is not None and (auto if config.async_decode is None else config.async_decode)
        self._in_flight: tuple[list[Chunk], Launched] | None = None
        # Seconds from arrival to first scheduled, and between two tokens of a sequence; the worker appends,
        # `drain_timings` takes them (deque appends and pops are thread-safe; bounded if nobody drains).
        self.queue_times: deque[float] = deque(maxlen=65536)
        self.inter_token_times: deque[float] = deque(maxlen=65536)
        self._inbox: queue.SimpleQueue[Sequence | Arrival | None] = queue.SimpleQueue()
        self.delivery = Delivery()  # the streams' sinks; a step's chunks go to each event loop in one callback
        self._queued = 0  # in the inbox or waiting; read on the event loop, approximate is fine
        # Requests whose images a colocated encoder here is encoding (counted on the event loop): to the CPU rule its
        # threads are this process's own time, and its images come before their sequences, so no step awaits them
        self.encoding = 0
        self._ids = itertools.count()
        self.dead: BaseException | None = None  # set when a tensor-parallel rank is lost: the replica must restart
        # An observer of each step, called on the worker with the step's chunks before they run (what a test watches:
        # each step's rows and threads). It may block, which holds the step, or raise, which fails the step's
        # sequences as any fault in a step does.
        self.on_step: Callable[[list[Chunk]], None] | None = None
        self._closing = False
        threading.Thread(target=self._loop, name="llm-engine", daemon=True).start()

    def stats(self) -> dict[str, float]:
        s = self.scheduler
        return {
            "waiting": s.num_waiting + self._inbox.qsize(),
            "running": len(s.running),
            "kv_usage": self.pool.usage,
            "prefix_hits": self.pool.hits,
            "prefix_queries": self.pool.queries,
            "preemptions": s.num_preemptions,
            "cancelled": s.num_cancelled,
            **self.counts,
        }

    def close(self) -> None:
        """Stop the worker after its current step (and the other tensor-parallel ranks with it)."""
        self._closing = True
        self._inbox.put(None)

    def drain_timings(self) -> tuple[list[float], list[float]]:
        """(queue times, inter-token times) recorded since the last call."""
        return (
            [self.queue_times.popleft() for _ in range(len(self.queue_times))],
            [self.inter_token_times.popleft() for _ in range(len(self.inter_token_times))],
        )

    def submit(
        self, inp: GenerateRequest, sink: Sink, embeds: Sequence_[torch.Tensor | asyncio.Future] = ()
    ) -> Sequence:
        """Check and queue a sequence; raises `InvalidRequest` or `Overloaded` at once. `embeds`: one per item of
        `inp`, its (num_tokens, D) embedding or an `asyncio.Future` of it on this event loop (see the module's
        docstring). `sink` is called on the caller's event loop with each `TokenChunk` (the last has a finish reason)
        or one exception; a step's chunks for all the sequences of one event loop arrive in one callback. `cancel`
        ends it early. A grammar is compiled here unless cached: `grammars.compile` it on a worker thread first to
        keep the loop free."""
        loop = asyncio.get_running_loop()
        grammar = self.grammars.compile(g) if (g := inp.sampling.grammar) is not None else None
        assert len(embeds) == len(inp.items), (len(embeds), len(inp.items))
        pending = {i: f for i, f in enumerate(embeds) if isinstance(f, asyncio.Future)}  # still encoding
        arrived = [None if i in pending else e for i, e in enumerate(embeds)]
        seq = make_sequence(
            inp, arrived, next(self._ids), grammar=grammar, eos_token_ids=self.eos_token_ids, **self._sequence_kwargs
        )
        if self.dead is not None:
            raise self._dead_error()
        if self._queued >= self.config.max_queued:
            raise Overloaded(f"the engine queue is full ({self._queued} requests waiting)")
        self._queued += 1
        self.delivery.attach(seq, loop, sink)
        self._inbox.put(seq)
        for i, future in pending.items():  # queued after the sequence: the worker sees them in that order
            future.add_done_callback(_on_arrival(seq, i, self._inbox.put))
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Nothing more reaches its sink; its blocks are free at the next step (a no-op once it has finished)."""
        self.delivery.detach(seq)
        seq.cancelled.set()
        self._inbox.put(None)  # wake the worker if it sleeps

    async def generate(
        self, inp: GenerateRequest, embeds: Sequence_[torch.Tensor | asyncio.Future] = ()
    ) -> AsyncIterator[TokenChunk]:
        """One sequence's chunks as a stream, at most one per `stream_interval_s` (first and last at once); a consumer
        that goes away cancels the sequence."""
        interval_s = self.config.stream_interval_s
        out: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
        seq = self.submit(inp, out.put_nowait, embeds)
        last_yield = 0.0
        try:
            while True:
                items = [await out.get()]
                wait = last_yield + interval_s - time.monotonic()
                if wait > 0 and not isinstance(items[0], BaseException) and items[0].finish_reason is None:
                    await asyncio.sleep(wait)  # coalesce: at most one message per interval per stream
                while not out.empty():
                    items.append(out.get_nowait())
                chunk, error = TokenChunk(), None
                for item in items:
                    if isinstance(item, BaseException):
                        error = item  # the worker sends nothing after an error
                        break
                    chunk.merge(item)
                if chunk.token_ids:  # tokens made before a fault still reach the client
                    last_yield = time.monotonic()
                    yield chunk
                if error is not None:
                    raise error
                if chunk.finish_reason is not None:
                    return
        finally:
            self.cancel(seq)  # a consumer that went away frees the sequence at the next step

    def _loop(self) -> None:
        threads = StepThreads.start(self.config, self.counts)  # None: the worker's threads stay as they are
        keepalive = getattr(self.model, "keepalive", None)  # tensor-parallel: the other ranks wait on us
        stalled = False  # the last schedule had nothing to run: only the inbox (an image, a request) changes that
        trace = StepTrace.from_env()
        while not self._closing:
            self._take_inbox(block=stalled or not (self.scheduler.running or self.scheduler.waiting))
            if self._in_flight is not None:  # its tokens come in next (after the step ahead of it is launched)
                chunks = self._in_flight[0]
            else:
                awaits = threads is not None and (self.scheduler.awaits_images or self.encoding > 0)
                chunks = self.scheduler.schedule(threads.budget(awaits) if threads is not None else None)
                stalled = not chunks
                if threads is not None and chunks:
                    threads.before_step(sum(c.n for c in chunks), awaits)
            self._queued = self.scheduler.num_waiting  # the admitted are no longer queued, even during a long step
            try:
                if not chunks:
                    if keepalive is not None:
                        keepalive()
                    continue
                if self.on_step is not None:
                    self.on_step(chunks)
                started, cpu = time.monotonic(), time.thread_time()
                with torch.inference_mode():
                    self._step(chunks)
                self.counts["step_cpu_s"] += time.thread_time() - cpu  # the worker's own CPU in steps
                if any(c.n > 1 for c in chunks):  # the time decodes waited on a prefill beside them
                    self.counts["prefill_step_s"] += time.monotonic() - started
                if trace is not None:
                    trace.record(started, chunks)
                self.delivery.flush()
            except RankFailure as e:  # the ranks are out of step for good: fail everything, serve nothing more
                return self._die(e)
            except Exception as e:  # a fault in a step fails the sequences in it; the engine keeps serving
                logger.exception("engine step failed for %d sequences", len(chunks))
                self._in_flight = None  # a step launched ahead holds some of the same sequences
                self.delivery.drop()  # the failed step's tokens: the error goes out instead (after earlier ones)
                for c in chunks:
                    self.delivery.emit(c.seq, e)
                    self.scheduler.finish(c.seq)
                    self.counts["failed"] += 1
                self.delivery.flush()
        if (close := getattr(self.model, "close", None)) is not None:
            try:
                close()
            except RankFailure:  # the other ranks are gone already
                pass

    def _dead_error(self) -> Overloaded:
        return Overloaded(
            f"this LLM replica lost a tensor-parallel rank and is restarting ({self.dead})", retry_after_s=5
        )

    def _die(self, e: RankFailure) -> None:
        logger.error("engine stopped: %s", e)
        self.dead = e
        error = self._dead_error()
        self.delivery.drop()
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self.delivery.emit(seq, error)
            self.counts["failed"] += 1
        self.delivery.flush()
        while True:  # whatever still arrives fails at once, so that no request waits for a step that never comes
            item = self._inbox.get()
            if item is not None:
                self.delivery.emit(item, error)
                self.delivery.flush()

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
            while True:
                if isinstance(item, Arrival):
                    self._image_arrived(item)
                elif item is not None:
                    self.scheduler.waiting.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _image_arrived(self, a: Arrival) -> None:
        """On the worker: the image joins its sequence; or its sequence fails with the error (it ends, its blocks
        back in the pool). Nothing for a sequence that has ended already (cancelled, or failed on another image)."""
        seq = a.seq
        if seq.cancelled.is_set() or not self.scheduler.holds(seq):
            return
        error = a.embeds if isinstance(a.embeds, BaseException) else None
        if error is None:
            try:
                seq.set_image(a.index, a.embeds)
            except ValueError as e:
                error = e
        if error is not None:  # EncoderUnavailable: the ingress retries it
            self.scheduler.finish(seq)
            self.counts["failed"] += not isinstance(error, InvalidRequest)  # a client's bad image is no engine fault
            self.delivery.emit(seq, error)
            self.delivery.flush()

    def _step(self, chunks: list[Chunk]) -> None:
        if (flight := self._in_flight) is not None:  # launch the step after it if it is known, then take its tokens
            self._in_flight = None
            if (ahead := self.scheduler.schedule_ahead(flight[0])) is not None:
                self._in_flight = (ahead[0], self.runner.launch(ahead[0], flight[1], ahead[1]))
                self.counts["steps"] += 1
                self.counts["ahead_steps"] += 1
            live = {id(s) for s in self.scheduler.running}  # a sequence that ended a step before wastes its row
            sampled = [s for s in self.runner.collect(flight[1]) if id(s.seq) in live]
            return self._advance([c for c in flight[0] if id(c.seq) in live], sampled)
        chunks = sorted(chunks, key=lambda c: (c.n != 1, c.start))  # one-token chunks first, shortest context first
        self.counts["steps"] += 1
        if self.ahead and self.runner.can_launch(chunks):
            self._in_flight = (chunks, self.runner.launch(chunks))
            return None
        return self._advance(chunks, self.runner.run(chunks))

    def _advance(self, chunks: list[Chunk], sampled: list[Sampled]) -> None:
        """A step's chunks are computed and their tokens sampled."""
        now = time.monotonic()
        for c in chunks:
            self.scheduler.advance(c)
            if c.seq.scheduled_at is None:
                c.seq.scheduled_at = now
                self.queue_times.append(now - c.seq.arrived_at)
        for s in sampled:
            try:
                self._append(s, now)
            except OffGrammar as e:  # that sequence alone fails (the scheduler ended it); the others go on
                error = self.grammars.refusal(e.matcher, e.token, s.seq.num_generated)
                self.counts["failed"] += not isinstance(error, InvalidRequest)  # a dead end is the client's grammar
                self.delivery.emit(s.seq, error)

    def _append(self, s: Sampled, now: float) -> None:
        """A sampled token: the scheduler applies the stop rules; its chunk goes to the sequence's sink."""
        seq, token = s.seq, s.token
        finish = self.scheduler.postprocess(seq, token)
        first = seq.num_generated == 1
        if seq.last_token_at is not None:
            self.inter_token_times.append(now - seq.last_token_at)
        seq.last_token_at = now
        self.delivery.emit(
            seq,
            TokenChunk(
                [token],
                finish,
                [s.logprob] if s.logprob is not None else None,
                seq.num_cached if first else None,
                seq.prompt_logprobs if first and seq.params.prompt_logprobs is not None else None,
            ),
        )
        if finish is not None:
            self.counts["finished"] += 1


__all__ = ["Engine", "EngineConfig"]
