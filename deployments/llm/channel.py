"""The LLM replica's half of the per-step token channel (deployments/ingress/channel.py says how it works): an
ingress's `Outbox` here collects each step's chunks of all that ingress's generations and sends them as one message."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from schemas import Batch, ChannelLost, Item, TokenChunk


def _final(item: Item) -> bool:
    return isinstance(item, BaseException) or item.finish_reason is not None


class Outbox:
    """LLM side: one ingress's channel on this replica. The engine's sinks (on the event loop) put chunks in, merged
    per generation; `stream` sends them as one message per step (or per `interval_s` when steps are shorter)."""

    def __init__(self, replica_id: str, interval_s: float, idle_s: float):
        self.replica_id, self.interval_s, self.idle_s = replica_id, interval_s, idle_s
        self.items: dict[str, list[Item]] = {}  # per generation: one merged chunk, then maybe an error
        self.attached: dict[str, asyncio.Future[None]] = {}  # done once its last item is handed over
        self.wake, self.urgent, self.open = asyncio.Event(), False, True

    def attach(self, request_id: str) -> tuple[asyncio.Future[None], Callable[[Item], None]]:
        """(a future done when the generation's last item has gone out, the engine sink that sends its items)."""
        assert self.open and request_id not in self.attached, request_id
        done = asyncio.get_running_loop().create_future()
        self.attached[request_id] = done

        def put(item: Item) -> None:
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


__all__ = ["Outbox"]
