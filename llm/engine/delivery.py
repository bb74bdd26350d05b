"""From the engine's worker thread to the streams' event loops: a step's chunks, one callback per event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

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


__all__ = ["Delivery", "Sink"]
