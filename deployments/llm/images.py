"""The LLM replica's side of a request's images: their embeddings fetched from the ObjectRefs the ingress sends (one
per encoder call, each the list of the embeddings that call made), one future per image or video, so that the engine's
prefill can run up to the first one not here yet."""

from __future__ import annotations

import asyncio
from typing import Any

import ray
import torch
from ray.exceptions import TaskCancelledError

from deployments.errors import REPLICA_GONE, root_cause
from schemas import EncoderUnavailable, InvalidRequest, MediaItem, observe

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


__all__ = ["ImageArrivals", "bad_image", "check_refs"]
