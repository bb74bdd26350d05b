"""A simple generation engine: one sequence at a time on a worker thread, a bounded queue in front of it.

The async side (`generate`) validates, enqueues, and streams `TokenChunk`s, coalescing whatever tokens are
ready so that a slow consumer gets fewer, larger chunks. Closing the stream cancels the sequence within one
decode step, and its cache goes with it. (Continuous batching replaces the worker loop; the API stays.)
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from llm.merge import merge_image_embeds
from llm.model import Qwen2LM
from llm.positions import mrope_positions
from llm.sampling import make_generator, sample
from schemas import InvalidRequest, Overloaded, SamplingParams, TokenChunk

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SequenceInput:
    request_id: str
    prompt_token_ids: list[int]
    image_grid_thw: list[tuple[int, int, int]]
    image_embeds: list[torch.Tensor]  # one (num_image_tokens, D) per image
    sampling: SamplingParams


@dataclass(slots=True)
class _Job:
    seq: SequenceInput
    input_ids: torch.Tensor  # (T,) CPU
    positions: torch.Tensor  # (3, T) CPU
    rope_delta: int
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)


class Engine:
    def __init__(self, model: Qwen2LM, *, image_token_id: int, merge_size: int, eos_token_ids: set[int],
                 max_model_len: int, max_queued: int):
        self.model, self.image_token_id, self.merge_size = model, image_token_id, merge_size
        self.eos_token_ids, self.max_model_len = frozenset(eos_token_ids), max_model_len
        self._jobs: queue.Queue[_Job] = queue.Queue(maxsize=max_queued)
        self.counts = {"running": 0, "finished": 0, "cancelled": 0, "failed": 0}  # written by the worker only
        threading.Thread(target=self._loop, name="llm-engine", daemon=True).start()

    def _prepare(self, seq: SequenceInput) -> tuple[torch.Tensor, torch.Tensor, int]:
        n_prompt, n_max = len(seq.prompt_token_ids), seq.sampling.max_tokens
        if n_prompt == 0:
            raise InvalidRequest("the prompt is empty")
        if n_prompt + n_max > self.max_model_len:
            raise InvalidRequest(
                f"{n_prompt} prompt tokens + max_tokens {n_max} exceed the context length of {self.max_model_len}",
                param="max_tokens", code="context_length_exceeded")
        input_ids = torch.tensor(seq.prompt_token_ids, dtype=torch.long)  # (T,)
        positions, rope_delta = mrope_positions(input_ids, self.image_token_id, seq.image_grid_thw, self.merge_size)
        for i, (grid, embeds) in enumerate(zip(seq.image_grid_thw, seq.image_embeds, strict=True)):
            expected = grid[0] * grid[1] * grid[2] // self.merge_size**2
            if embeds.shape[0] != expected:
                raise ValueError(f"image {i}: {embeds.shape[0]} embedding rows for a grid of {expected} tokens")
        return input_ids, positions, rope_delta

    async def generate(self, seq: SequenceInput) -> AsyncIterator[TokenChunk]:
        input_ids, positions, rope_delta = self._prepare(seq)
        job = _Job(seq, input_ids, positions, rope_delta, asyncio.get_running_loop(), asyncio.Queue())
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise Overloaded(f"the engine queue is full ({self._jobs.maxsize} requests waiting)") from None
        try:
            while True:
                items = [await job.out.get()]
                while not job.out.empty():
                    items.append(job.out.get_nowait())
                chunk, error = TokenChunk(), None
                for item in items:
                    if isinstance(item, BaseException):
                        error = item  # the worker stops at an error: nothing follows it
                        break
                    chunk.token_ids.extend(item.token_ids)
                    chunk.finish_reason = item.finish_reason
                if chunk.token_ids:  # tokens made before a fault still reach the client
                    yield chunk
                if error is not None:
                    raise error
                if chunk.finish_reason is not None:
                    return
        finally:
            job.cancelled.set()  # a consumer that went away frees the sequence at the next step

    def stats(self) -> dict[str, int]:
        return {"waiting": self._jobs.qsize(), **self.counts}

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            outcome = "cancelled"
            if not job.cancelled.is_set():
                self.counts["running"] += 1
                try:
                    with torch.inference_mode():
                        self._run(job)
                    outcome = "cancelled" if job.cancelled.is_set() else "finished"
                except Exception as e:  # reported to that request alone; the engine keeps serving
                    logger.exception("request %s failed in the engine", job.seq.request_id)
                    self._emit(job, e)
                    outcome = "failed"
                self.counts["running"] -= 1
            self.counts[outcome] += 1

    def _emit(self, job: _Job, item: TokenChunk | BaseException) -> None:
        try:
            job.loop.call_soon_threadsafe(job.out.put_nowait, item)
        except RuntimeError:  # the event loop is gone: nobody is listening
            job.cancelled.set()

    def _run(self, job: _Job) -> None:
        model, seq, params = self.model, job.seq, job.seq.sampling
        stop_ids = params.stop_token_ids | (frozenset() if params.ignore_eos else self.eos_token_ids)
        embeds = model.embed(job.input_ids)  # (T, D)
        if seq.image_embeds:
            embeds = merge_image_embeds(embeds, job.input_ids == self.image_token_id, torch.cat(seq.image_embeds))
        n = job.input_ids.shape[0]
        cache = model.new_cache(n + params.max_tokens)
        logits = model.logits(model(embeds, job.positions, cache, start=0)[-1])  # (V,)
        generator = make_generator(params, logits.device)
        for step in range(params.max_tokens):
            if job.cancelled.is_set():
                return
            token = int(sample(logits, params, generator))
            finish = "stop" if token in stop_ids else "length" if step + 1 == params.max_tokens else None
            self._emit(job, TokenChunk([token], finish))
            if finish is not None:
                return
            position = torch.full((3, 1), n + job.rope_delta, dtype=torch.long)  # decode: cache length + delta
            hidden = model(model.embed(torch.tensor([token])), position, cache, start=n)  # (1, D)
            logits = model.logits(hidden[-1])
            n += 1


__all__ = ["Engine", "SequenceInput"]
