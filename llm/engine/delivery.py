"""From the engine's worker thread to the streams' event loops: a step's chunks, one callback per event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from llm.engine.sequence import Sequence
from schemas import TokenChunk

Sink = Callable[[TokenChunk | BaseException], None]
Item = tuple[Sequence, Sink, TokenChunk | BaseException]


class Delivery:
    """Each live stream's event loop and sink, by seq_id: `attach` adds, `detach` removes (on the event loop). The
    worker `emit`s a step's items, collected per loop, and `flush`es them: one callback per loop, not one per
    sequence and token."""

    def __init__(self) -> None:
        self._sinks: dict[int, tuple[asyncio.AbstractEventLoop, Sink]] = {}
        self._pending: dict[asyncio.AbstractEventLoop, list[Item]] = {}

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

    def _deliver(self, items: list[Item]) -> None:
        for seq, sink, item in items:  # on the event loop: a stream cancelled since the step gets nothing more
            if (entry := self._sinks.get(seq.seq_id)) is not None and entry[1] is sink:
                sink(item)


async def coalesced(
    submit: Callable[[Sink], Sequence], cancel: Callable[[Sequence], None], interval_s: float
) -> AsyncIterator[TokenChunk]:
    """`Engine.generate`: one sequence's chunks as a stream, at most one per `interval_s` (first and last at once);
    a consumer that goes away cancels the sequence."""
    out: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
    seq = submit(out.put_nowait)
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
        cancel(seq)  # a consumer that went away frees the sequence at the next step


__all__ = ["Delivery", "Sink", "coalesced"]
