"""The per-step token channel between an ingress replica and an LLM replica: one message per step, not per token.

Without it each generation streams its own chunks: at 32 streams that is a Ray message per request per step, each
one serialized, reported and awaited on both sides. With it, an ingress replica holds one streaming call per LLM
replica it uses (`LLM.channel`, pinned to that replica by deployments/llm/router.py), and the LLM replica sends each
step's chunks for all of that ingress's generations as one list of (request id, chunk or error) pairs. vLLM does the
same between its engine core and its front end (one output batch per step); this one rides on Serve's own calls:

- A generation is still its own call (`LLM.generate`, with `GenerateRequest.channel` = the ingress's id): routing,
  admission, cancellation and a replica's death work on it as before. Its stream starts with a `Routed`: which
  replica took it, and whether its chunks come through the channel. If not (no channel open there yet), they follow
  on the call's own stream and the ingress opens a channel to that replica for later generations. If so, the own
  stream carries nothing more and ends once its last chunk is handed to the channel, or raises `ChannelLost` if the
  channel closed first.
- The LLM replica closes a channel that has had no generation for `idle_s` (so that a draining replica drains:
  Serve waits for its calls to end); the ingress reopens it on the next `Routed(via_channel=False)`. A channel
  stream that ends on the ingress fails the generations still attached to it.
- Messages: at most one per `interval_s` per channel; a first token, a last one and an error go at once.

Both ends are here: the ingress's (`ChannelHub`, `TokenStream`), the LLM replica's (`Outbox`), and their messages
(`Routed`, `ChannelOpen`, `Batch`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from deployments.ray_private import assigned
from schemas import ChannelLost, Overloaded, TokenChunk

# The channel's messages


@dataclass(slots=True)
class Routed:
    """The first item of a generation's own stream when the ingress asked for the channel."""

    replica_id: str
    via_channel: bool


@dataclass(slots=True)
class ChannelOpen:
    """The argument of `LLM.channel`: who listens, and which LLM replica the router must send it to."""

    ingress_id: str
    replica_id: str


Output = TokenChunk | BaseException  # what a generation sends: a chunk, or the error that ended it
Batch = list[tuple[str, Output]]  # one channel message: (request id, chunk or error), in the order they were made

logger = logging.getLogger("ray.serve")


class ChannelHub:
    """Ingress side: this ingress replica's channels, one per LLM replica it has used, and the routes from their
    messages to the generations waiting for them."""

    def __init__(self, llm: Any, ingress_id: str | None = None):
        self.llm, self.id = llm, ingress_id or uuid.uuid4().hex
        self.routes: dict[str, Callable[[Output], None]] = {}  # request id -> its TokenStream's queue
        self.readers: dict[str, asyncio.Task] = {}  # LLM replica id -> the task reading its channel
        self.calls: dict[str, Any] = {}  # LLM replica id -> its channel's streaming call
        self.closed = False
        self.attached: dict[str, set[str]] = {}  # LLM replica id -> request ids whose chunks come through it
        self.messages = 0  # channel messages received (for the message-rate figures)

    def open(self, replica_id: str) -> None:
        """Start reading `replica_id`'s channel. NOTE: in a context of its own: the channel serves every generation,
        and a call made in a request's context is that request's child, which Serve cancels when the request is
        cancelled (its client left): the channel, and the generations of every other client attached to it, with it."""
        if replica_id not in self.readers:
            reader = self._read(replica_id)
            self.readers[replica_id] = asyncio.get_running_loop().create_task(reader, context=contextvars.Context())

    def close(self) -> None:
        """End every channel now: this ingress replica is stopping, and Serve drained its requests first. An LLM
        replica's own drain then does not wait `llm.token_channel_idle_s` for them to idle out (Serve stops the replicas
        of a deleted app all at once)."""
        self.closed = True
        for call in self.calls.values():
            call.cancel()

    async def _read(self, replica_id: str) -> None:
        call = self.calls[replica_id] = self.llm.options(stream=True).channel.remote(ChannelOpen(self.id, replica_id))
        try:
            async for batch in call:
                self.messages += 1
                for rid, item in batch:
                    if (route := self.routes.get(rid)) is not None:
                        route(item)
        except Exception as e:  # the replica went away (its generations fail on their own calls too)
            if not self.closed:
                logger.warning("token channel to LLM replica %s ended: %s", replica_id, e)
        finally:
            call.cancel()
            del self.readers[replica_id], self.calls[replica_id]
            for rid in self.attached.pop(replica_id, ()):
                if (route := self.routes.get(rid)) is not None:
                    route(ChannelLost(replica_id))


_END = object()  # a generation's own stream ended
# How long a generation (its first attempt, and its second after its LLM replica died) waits for a replica to take it:
# a live one takes it at once (its engine refuses past its own queue, far below max_ongoing_requests); none live means
# the replicas are restarting or cannot start, which takes longer than a client should wait for an answer it can get
# by retrying (503, Retry-After). Without it a request waits in Serve's router queue until its deadline.
ROUTE_TIMEOUT_S = 10.0


class TokenStream:
    """Ingress side: one generation's `TokenChunk`s, from its own call's stream or through its replica's channel."""

    def __init__(self, hub: ChannelHub, call: Any, request_id: str, route_timeout_s: float | None = None):
        self.hub, self.call, self.request_id = hub, call, request_id
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.replica: str | None = None  # set when the chunks come through that replica's channel
        hub.routes[request_id] = self.queue.put_nowait
        self._pump = asyncio.ensure_future(self._read_own(route_timeout_s))

    async def _read_own(self, route_timeout_s: float | None) -> None:
        put = self.queue.put_nowait
        try:
            if route_timeout_s is not None:
                try:
                    async with asyncio.timeout(route_timeout_s):  # NOTE: not wait_for: see tests/test_house.py
                        await assigned(self.call)
                except TimeoutError:
                    self.call.cancel()
                    put(Overloaded(f"no LLM replica took the request in {route_timeout_s:g} s", retry_after_s=5))
                    return
            async for item in self.call:
                if not isinstance(item, Routed):
                    put(item)
                elif not item.via_channel:
                    self.hub.open(item.replica_id)
                elif self.request_id not in self.hub.routes:  # closed meanwhile (the client left): attach nothing
                    return
                elif item.replica_id in self.hub.readers:
                    self.replica = item.replica_id
                    self.hub.attached.setdefault(item.replica_id, set()).add(self.request_id)
                else:  # our reader of that channel has ended already: nothing will bring its chunks
                    put(ChannelLost(item.replica_id))
            if self.replica is None:
                put(_END)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            put(e)

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> TokenChunk:
        item = await self.queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self, cancel: bool) -> None:
        """Stop listening; `cancel`: also cancel the generation (not after its last chunk: see Ingress._events)."""
        self.hub.routes.pop(self.request_id, None)
        if self.replica is not None:
            self.hub.attached.get(self.replica, set()).discard(self.request_id)
        if cancel:
            self.call.cancel()


def _final(item: Output) -> bool:
    return isinstance(item, BaseException) or item.finish_reason is not None


class Outbox:
    """LLM side: one ingress's channel on this replica. The engine's sinks (on the event loop) put chunks in, merged
    per generation; `stream` sends them as one message per step (or per `interval_s` when steps are shorter)."""

    def __init__(self, replica_id: str, interval_s: float, idle_s: float):
        self.replica_id, self.interval_s, self.idle_s = replica_id, interval_s, idle_s
        self.items: dict[str, list[Output]] = {}  # per generation: one merged chunk, then maybe an error
        self.attached: dict[str, asyncio.Future[None]] = {}  # done once its last item is handed over
        self.wake, self.urgent, self.open = asyncio.Event(), False, True

    def attach(self, request_id: str) -> tuple[asyncio.Future[None], Callable[[Output], None]]:
        """(a future done when the generation's last item has gone out, the engine sink that sends its items)."""
        assert self.open and request_id not in self.attached, request_id
        done = asyncio.get_running_loop().create_future()
        self.attached[request_id] = done

        def put(item: Output) -> None:
            if request_id not in self.attached:
                return
            items = self.items.setdefault(request_id, [])
            if items and isinstance(item, TokenChunk) and isinstance(items[-1], TokenChunk):
                items[-1].merge(item)
            else:
                items.append(item)
            if _final(item) or (isinstance(item, TokenChunk) and item.num_cached_tokens is not None):  # first token
                self.urgent = True
            self.wake.set()

        return done, put

    def detach(self, request_id: str) -> None:
        """A generation that ended early (cancelled): nothing more of it goes out."""
        self.attached.pop(request_id, None)
        self.items.pop(request_id, None)

    async def stream(self) -> AsyncIterator[Batch]:
        loop, last = asyncio.get_running_loop(), 0.0
        try:
            while True:
                try:
                    async with asyncio.timeout(self.idle_s):  # NOTE: not wait_for: see tests/test_house.py
                        await self.wake.wait()
                except TimeoutError:
                    if not self.attached:
                        return  # idle: closed; the ingress reopens it when it needs it
                    continue
                if not self.urgent and (wait := last + self.interval_s - loop.time()) > 0:
                    await asyncio.sleep(wait)
                self.wake.clear()
                self.urgent, items, self.items = False, self.items, {}
                batch = [(rid, item) for rid, its in items.items() for item in its]
                if not batch:
                    continue
                last = loop.time()
                yield batch
                for rid, item in batch:
                    if _final(item) and (done := self.attached.pop(rid, None)) is not None and not done.done():
                        done.set_result(None)
        finally:
            self.open = False
            for done in self.attached.values():
                if not done.done():
                    done.set_exception(ChannelLost(self.replica_id))
            self.attached.clear()


__all__ = ["ROUTE_TIMEOUT_S", "Batch", "ChannelHub", "ChannelOpen", "Outbox", "Routed", "TokenStream"]
