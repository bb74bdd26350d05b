"""The per-step token channel's two ends without Ray (deployments/channel.py): what goes in one message, when it
goes, and that every way a channel or a generation can end leaves nobody waiting."""

from __future__ import annotations

import asyncio
import gc
import sys

import pytest
from pydantic import ValidationError

from deployments.channel import ChannelHub, Outbox, Routed, TokenStream
from schemas import ChannelLost, InvalidRequest, TokenChunk

INTERVAL = 0.05


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def _next(stream) -> list:
    return await asyncio.wait_for(anext(stream), 2)


def test_one_message_carries_each_generations_chunks_of_the_interval_merged():
    async def go():
        box = Outbox("r1", INTERVAL, idle_s=5)
        (done_a, put_a), (done_b, put_b) = box.attach("a"), box.attach("b")
        out = box.stream()
        put_a(TokenChunk([1], num_cached_tokens=0))  # a first token goes at once
        first = await _next(out)
        assert first == [("a", TokenChunk([1], num_cached_tokens=0))]
        put_a(TokenChunk([2]))  # later tokens wait for the interval, merged per generation
        put_b(TokenChunk([7]))
        put_a(TokenChunk([3]))
        loop = asyncio.get_running_loop()
        started = loop.time()
        second = await _next(out)
        assert loop.time() - started >= INTERVAL * 0.8
        assert second == [("a", TokenChunk([2, 3])), ("b", TokenChunk([7]))]
        put_b(TokenChunk([8], finish_reason="length"))  # a last token goes at once, and ends b's call
        assert await _next(out) == [("b", TokenChunk([8], finish_reason="length"))]
        third = asyncio.ensure_future(anext(out))  # handed over once the channel asks for the next message
        await asyncio.sleep(0)
        assert done_b.done() and not done_a.done()
        put_a(TokenChunk([4]))
        put_a(InvalidRequest("boom"))  # tokens before an error still go, before it
        third = await asyncio.wait_for(third, 2)
        assert [rid for rid, _ in third] == ["a", "a"] and third[0][1] == TokenChunk([4])
        assert isinstance(third[1][1], InvalidRequest)
        fourth = asyncio.ensure_future(anext(out))
        await asyncio.sleep(0)
        assert done_a.done() and done_a.exception() is None
        fourth.cancel()
        await asyncio.gather(fourth, return_exceptions=True)

    _run(go())


def test_an_idle_channel_closes_only_with_nothing_attached_and_a_closed_one_fails_what_is():
    async def go():
        box = Outbox("r1", INTERVAL, idle_s=0.1)
        done, put = box.attach("a")
        out = box.stream()
        pending = asyncio.ensure_future(anext(out))
        await asyncio.sleep(0.3)  # idle three times over, but a generation is attached (waiting in the queue)
        assert not pending.done()
        box.detach("a")  # cancelled: nothing of it goes out any more
        put(TokenChunk([1], finish_reason="stop"))
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(pending, 1)
        assert not box.open

        box = Outbox("r2", INTERVAL, idle_s=5)
        done, _ = box.attach("b")
        out = box.stream()
        pending = asyncio.ensure_future(anext(out))
        await asyncio.sleep(0.05)
        pending.cancel()  # the channel call went away (its ingress died, or cancelled it)
        await asyncio.gather(pending, return_exceptions=True)
        await out.aclose()
        with pytest.raises(ChannelLost):
            await done

    _run(go())


class _Call:
    """A Serve streaming call: yields `items` (an exception is raised), then waits for `release` if given."""

    def __init__(self, items, release: asyncio.Event | None = None):
        self.items, self.release, self.cancelled = items, release, False

    def cancel(self):
        self.cancelled = True

    async def _gen(self):
        for item in self.items:
            await asyncio.sleep(0)
            if isinstance(item, BaseException):
                raise item
            yield item
        if self.release is not None:
            await self.release.wait()

    def __aiter__(self):
        return self._gen()


class _LLM:
    """The LLM handle as the hub uses it: `options(stream=True).channel.remote(open)` -> the channel's call."""

    def __init__(self, channel: _Call):
        self.channel_call, self.opened = channel, []
        self.channel = self

    def options(self, **_):
        return self

    def remote(self, req):
        self.opened.append(req)
        return self.channel_call


def test_without_a_channel_the_chunks_come_on_the_own_stream_and_the_hub_opens_one():
    async def go():
        release = asyncio.Event()
        hub = ChannelHub(_LLM(_Call([], release)), "ing")
        own = _Call([Routed("r1", via_channel=False), TokenChunk([5]), TokenChunk([6], finish_reason="stop")])
        stream = TokenStream(hub, own, "req-0")
        assert [c.token_ids for c in [await _next(stream), await _next(stream)]] == [[5], [6]]
        assert [(o.ingress_id, o.replica_id) for o in hub.llm.opened] == [("ing", "r1")]
        assert "r1" in hub.readers
        stream.close(cancel=False)
        assert not own.cancelled and "req-0" not in hub.routes
        broken = TokenStream(hub, _Call([Routed("r1", via_channel=False), TokenChunk([5])]), "req-1")
        await _next(broken)
        with pytest.raises(StopAsyncIteration):  # an own stream that ends without a finish reason is not a hang
            await _next(broken)
        release.set()

    _run(go())


def test_channel_chunks_reach_their_stream_and_a_lost_channel_fails_the_attached_ones():
    async def go():
        gate = asyncio.Event()
        batch = [
            ("req-0", TokenChunk([1], num_cached_tokens=0)),
            ("other", TokenChunk([9])),
            ("req-0", TokenChunk([2], finish_reason="length")),
        ]

        class Channel(_Call):
            async def _gen(self):
                await gate.wait()
                yield batch
                yield [("req-1", TokenChunk([3], num_cached_tokens=0))]
                raise ConnectionError("replica gone")

        hub = ChannelHub(_LLM(Channel([])), "ing")
        hub.open("r1")
        own0, own1 = _Call([Routed("r1", via_channel=True)]), _Call([Routed("r1", via_channel=True)], asyncio.Event())
        s0, s1 = TokenStream(hub, own0, "req-0"), TokenStream(hub, own1, "req-1")
        await asyncio.sleep(0.01)
        assert hub.attached["r1"] == {"req-0", "req-1"}
        gate.set()
        assert [(await _next(s0)).token_ids, (await _next(s0)).token_ids] == [[1], [2]]
        s0.close(cancel=False)
        assert (await _next(s1)).token_ids == [3]
        with pytest.raises(ChannelLost):  # the channel broke with req-1 still on it
            await _next(s1)
        s1.close(cancel=True)
        assert own1.cancelled and not own0.cancelled and hub.messages == 2 and "r1" not in hub.readers
        late = TokenStream(hub, _Call([Routed("r1", via_channel=True)]), "req-2")
        with pytest.raises(ChannelLost):  # routed to a channel this ingress no longer reads
            await _next(late)

    _run(go())


def test_an_error_on_the_own_stream_reaches_the_client():
    async def go():
        hub = ChannelHub(_LLM(_Call([])), "ing")
        stream = TokenStream(hub, _Call([InvalidRequest("too long", param="messages")]), "req-0")
        with pytest.raises(InvalidRequest, match="too long"):
            await _next(stream)

    _run(go())


def test_a_stream_closed_before_its_replica_is_known_leaves_nothing_attached():
    """A client that leaves before the LLM replica said where the chunks come from: when that word arrives after
    the close, the request id must not stay attached to the channel for good (it grew the ingress with every such
    request in a 30,000-request soak)."""

    async def go():
        hub = ChannelHub(_LLM(_Call([], asyncio.Event())), "ing")
        hub.open("r1")
        routed = asyncio.Event()

        class Late(_Call):
            async def _gen(self):
                await routed.wait()
                yield Routed("r1", via_channel=True)

        stream = TokenStream(hub, Late([]), "req-0")
        await asyncio.sleep(0.01)
        stream.close(cancel=False)
        routed.set()
        await asyncio.wait_for(stream._pump, 2)
        assert hub.attached.get("r1", set()) == set() and "req-0" not in hub.routes

    _run(go())


def test_a_stopping_ingress_ends_its_channels_at_once_and_quietly(caplog, checkpoint):
    """Serve calls the Ingress's `__del__` once the replica has drained: its channel calls are cancelled then, so an
    LLM replica stopped beside it (a deleted app) does not wait `token_channel_idle_s` for them."""
    from deployments.ingress.server import Ingress

    class Waiting(_Call):  # a channel with nothing to say: it ends when cancelled, as Serve's call does
        def cancel(self):
            super().cancel()
            self.release.set()

        async def _gen(self):
            await self.release.wait()
            raise RuntimeError("cancelled")
            yield

    async def go():
        call = Waiting([], asyncio.Event())
        ingress = Ingress.func_or_class(None, _LLM(call), {"model": str(checkpoint)})
        ingress.hub.open("r1")
        await asyncio.sleep(0.01)
        assert "r1" in ingress.hub.calls and not call.cancelled
        ingress.__del__()
        assert call.cancelled
        await asyncio.sleep(0.01)
        assert not ingress.hub.readers and not ingress.hub.calls

    with caplog.at_level("WARNING", logger="ray.serve"):
        _run(go())
    assert not [r for r in caplog.records if "token channel" in r.getMessage()]


def test_an_ingress_that_fails_to_start_has_nothing_to_close(monkeypatch):
    """A refused config fails the Ingress's __init__ before it has a hub; the half-made replica's __del__ (Python
    calls it) raises nothing."""
    from deployments.ingress.server import Ingress

    raised = []
    monkeypatch.setattr(sys, "unraisablehook", raised.append)  # where an error in __del__ goes
    with pytest.raises(ValidationError):
        Ingress.func_or_class(None, _LLM(_Call([])), {"model": "/no/such/checkpoint"})
    gc.collect()
    assert raised == []
