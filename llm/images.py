"""The LLM replica's side of a request's images: their embeddings fetched from the ObjectRefs the ingress sends, one
future per image or video, so that the engine's prefill can run up to the first one not here yet."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import ray
import torch
from ray.exceptions import TaskCancelledError

from schemas import EncoderUnavailable, InvalidRequest, observe, root_cause
from schemas.errors import REPLICA_GONE

# Errors that mean "the encoder replica (or its node) went away", not "this image is bad".
_ENCODER_GONE = (*REPLICA_GONE, TaskCancelledError)


def bad_image(index: int, e: InvalidRequest) -> InvalidRequest:
    """An image the encoder could not read is the client's error; say which one."""
    return InvalidRequest(f"image {index}: {e.message}", param="messages")


def _check_refs(refs: list[Any]) -> None:
    for ref in refs:  # invariant: the ingress passes references, never embeddings
        if not isinstance(ref, ray.ObjectRef):
            raise TypeError(f"image embeddings must arrive as ObjectRefs, got {type(ref).__name__}")


async def fetch_embeds(refs: list[Any], timeout_s: float, first: int = 0) -> list[torch.Tensor]:
    """The embeddings of `refs`, images `first`, `first` + 1, ... of the request (the ingress's numbering of its
    encoder calls). EncoderUnavailable names those whose encoder replica went away or that did not come in
    `timeout_s`: the ingress retries them on another replica."""
    _check_refs(refs)
    tasks = [asyncio.ensure_future(ref) for ref in refs]
    try:
        done, pending = await asyncio.wait(tasks, timeout=timeout_s) if tasks else (set(), set())
    finally:  # also when this generation is cancelled: no task left to fail unobserved
        for task in tasks:
            task.cancel()
            task.add_done_callback(observe)
    lost = [first + i for i, t in enumerate(tasks) if t in pending]
    for i, task in enumerate(tasks, start=first):
        if task in done and task.exception() is not None:
            cause = root_cause(task.exception())
            if isinstance(cause, InvalidRequest):
                raise bad_image(i, cause) from None
            if not isinstance(cause, _ENCODER_GONE):
                raise task.exception()
            lost.append(i)
    if lost:
        raise EncoderUnavailable(f"no embeddings for images {sorted(lost)}", sorted(lost))
    return [t.result() for t in tasks]


async def _fetch_item(refs: list[Any], timeout_s: float, first: int) -> torch.Tensor:
    embeds = await fetch_embeds(refs, timeout_s, first)
    return embeds[0] if len(embeds) == 1 else torch.cat(embeds)  # a video's chunks, in order, are its embedding


def per_item(embeds: list[torch.Tensor], embeds_per_item: list[int]) -> list[torch.Tensor]:
    """One embedding per image or video: a video's chunks, in order, concatenated."""
    if not embeds_per_item:
        return embeds
    at = list(itertools.accumulate(embeds_per_item, initial=0))
    return [torch.cat(embeds[a:b]) for a, b in itertools.pairwise(at)]


def image_arrivals(refs: list[Any], embeds_per_item: list[int], timeout_s: float) -> list[asyncio.Future]:
    """One future per image or video (`embeds_per_item`: how many refs make each; empty: one each), done with its
    (num_tokens, D) embedding, or failed as `fetch_embeds` fails. Cancel those left when the generation ends."""
    _check_refs(refs)  # here, before the generation starts
    at = list(itertools.accumulate(embeds_per_item or [1] * len(refs), initial=0))
    return [asyncio.ensure_future(_fetch_item(refs[a:b], timeout_s, a)) for a, b in itertools.pairwise(at)]


__all__ = ["bad_image", "fetch_embeds", "image_arrivals", "per_item"]
