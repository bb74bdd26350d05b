"""Images still being encoded when their request reaches the engine (prefill overlapped with encoding): a request's
embeddings may be futures; the sequence is queued at once and each image arrives on its own, in any order, through
the worker's inbox. An image that fails fails its sequence with the future's error."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llm.engine.scheduler import Scheduler
from llm.engine.sequence import Sequence


@dataclass(slots=True)
class Arrival:
    """An image's embeddings (or the error that ended its encoding), for a sequence that waits for them."""

    seq: Sequence
    index: int
    embeds: torch.Tensor | BaseException


def split_pending(
    embeds: list[torch.Tensor | asyncio.Future],
) -> tuple[list[torch.Tensor | None], dict[int, asyncio.Future]]:
    """The embeddings with None for each still a future, and those futures by image index."""
    pending = {i: f for i, f in enumerate(embeds) if isinstance(f, asyncio.Future)}
    return [None if i in pending else e for i, e in enumerate(embeds)], pending


def on_arrival(seq: Sequence, index: int, put: Callable[[Arrival], None]) -> Callable[[asyncio.Future], None]:
    """A done-callback (on the event loop) that hands the worker what the future holds. A cancelled future: the
    generation ended, and its sequence with it."""

    def done(future: asyncio.Future) -> None:
        if not future.cancelled():
            put(Arrival(seq, index, future.exception() or future.result()))

    return done


def take_arrival(a: Arrival, scheduler: Scheduler) -> BaseException | None:
    """On the worker: the image joins its sequence; or the error its sequence fails with (it has ended then, its
    blocks back in the pool). Nothing for a sequence that has ended already (cancelled, or failed on another image)."""
    seq = a.seq
    if seq.cancelled.is_set() or not scheduler.holds(seq):
        return None
    error = a.embeds if isinstance(a.embeds, BaseException) else None
    if error is None:
        try:
            seq.set_image(a.index, a.embeds)
        except ValueError as e:
            error = e
    if error is not None:
        scheduler.finish(seq)
    return error


__all__ = ["Arrival", "on_arrival", "split_pending", "take_arrival"]
