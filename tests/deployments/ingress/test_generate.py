"""Generator.start_all, without Ray: a text completion's prompts start at once, their choices numbered prompt by
prompt, and when one prompt fails the generations the others started are closed (cancelled), not leaked. Images
lost on the way are encoded once more, each at most once; a generation whose LLM replica was lost before its first
token goes once more."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from deployments.ingress.channel import ChannelHub
from deployments.ingress.generate import Generator
from deployments.ingress.prepare import Prepared
from schemas import EncoderUnavailable, InvalidRequest, Overloaded, Routed, SamplingParams, TokenChunk


class FakeStream:
    def __init__(self):
        self.closed = False

    async def aclose(self):
        self.closed = True


def _generator(fail_prompt: int | None = None, delay_s: dict[int, float] | None = None):
    """A Generator whose `start` opens fake streams (first delta: the choice's number), failing for `fail_prompt`."""
    gen = Generator.__new__(Generator)
    opened: list[FakeStream] = []

    async def start(p, params, stops, request_id, first=0):
        await asyncio.sleep((delay_s or {}).get(p.prompt[0], 0))
        if p.prompt[0] == fail_prompt:
            raise InvalidRequest(f"prompt {fail_prompt} is bad")
        streams = [FakeStream() for _ in params]
        opened.extend(streams)
        return streams, [first + i for i in range(len(params))]

    gen.start = start
    return gen, opened


def _start_all(gen: Generator, n: int = 2, prompts: int = 3):
    return asyncio.run(gen.start_all([Prepared(prompt=[k]) for k in range(prompts)], [[None] * n] * prompts, [], "r"))


def test_choices_are_numbered_prompt_by_prompt():
    gen, opened = _generator(delay_s={0: 0.02})  # the first prompt starts last: the order is still the prompts'
    streams, firsts = _start_all(gen)
    assert firsts == [0, 1, 2, 3, 4, 5] and len(streams) == 6 and not any(s.closed for s in opened)


@pytest.mark.parametrize("delay_s", [{}, {1: 0.05}, {0: 0.05, 2: 0.05}])
def test_one_failing_prompt_closes_what_the_others_started(delay_s):
    """Whether the others started before the failure or were still starting (then cancelled), nothing stays open."""
    gen, opened = _generator(fail_prompt=1, delay_s=delay_s)
    with pytest.raises(InvalidRequest, match="prompt 1 is bad"):
        _start_all(gen)
    assert all(s.closed for s in opened)
    if not delay_s:
        assert len(opened) == 4  # prompts 0 and 2 had started: their streams were closed


def _retrying(failures: list[list[int]]):
    """A Generator whose LLM loses the images of each of `failures` in turn (then answers with the refs it got), and
    whose encoder calls return a ref naming the image and how often it was encoded."""
    gen = Generator.__new__(Generator)
    gen.counts = {"encoder_retries": 0, "encoder_failures": 0}
    encoded: dict[int, int] = {}

    async def encode(p, indices, calls):
        for i in indices:
            encoded[i] = encoded.get(i, 0) + 1
        return [f"image {i}, encode {encoded[i]}" for i in indices]

    async def generate(p, params, text, refs, request_id, first):
        if failures:
            lost = failures.pop(0)
            raise EncoderUnavailable(f"no embeddings for images {lost}", lost)
        return list(refs)

    gen._encode, gen._generate = encode, generate
    return gen


def _encode_and_generate(gen: Generator, images: int = 3):
    return asyncio.run(gen._encode_and_generate(Prepared(jobs=[b""] * images), [], [], "r", 0, []))


def test_each_lost_image_is_encoded_once_more_as_it_fails():
    """The LLM reports a lost image as soon as that one fails: a second image lost later is retried too."""
    gen = _retrying([[1], [2]])
    refs = _encode_and_generate(gen)
    assert refs == ["image 0, encode 1", "image 1, encode 2", "image 2, encode 2"]
    assert gen.counts == {"encoder_retries": 2, "encoder_failures": 0}


def test_an_image_lost_twice_is_a_503():
    gen = _retrying([[1], [0, 1]])
    with pytest.raises(Overloaded, match="image encoding failed twice"):
        _encode_and_generate(gen)
    assert gen.counts == {"encoder_retries": 1, "encoder_failures": 1}


class _Assigned:
    """An encoder call whose ObjectRef is `ref` (a future the test completes)."""

    def __init__(self, ref: asyncio.Future):
        self.ref = ref

    async def _to_object_ref(self):
        return await self.ref

    def cancel(self):
        pass


@pytest.mark.parametrize("turns", range(8))
def test_a_request_cancelled_as_its_images_are_assigned_stays_cancelled(turns):
    """Serve cancels a request's calls, then the request (direct ingress, the client gone): the images' refs complete
    a few turns of the loop before the cancellation reaches the waiting request. Whatever the turn, the request ends
    cancelled; with asyncio.wait_for (Python 3.11) one of these turns returned the refs and the request went on to
    generate for nobody."""

    async def run():
        ref = asyncio.get_running_loop().create_future()
        gen = Generator.__new__(Generator)
        gen.encoder = SimpleNamespace(encode=SimpleNamespace(remote=lambda *a, **k: _Assigned(ref)))
        gen.args = SimpleNamespace(encoder=SimpleNamespace(timeout_s=30))
        p = Prepared(jobs=[b"x", b"y"], job_keys=["a", "b"], job_costs=[1.0, 1.0])
        waiting = asyncio.ensure_future(gen._encode(p, [0, 1], []))
        await asyncio.sleep(0.01)
        ref.set_result("ref")
        for _ in range(turns):
            await asyncio.sleep(0)
        done_first = waiting.done()  # then it had its refs before the cancellation: nothing was dropped
        waiting.cancel()
        try:
            return done_first, await waiting
        except asyncio.CancelledError:
            return done_first, "cancelled"

    done_first, outcome = asyncio.run(run())
    assert outcome == (["ref", "ref"] if done_first else "cancelled")


class _Call:
    """A Serve streaming call (already taken by a replica): yields `items`, then stays open (its end not yet seen)."""

    def __init__(self, items):
        self.items, self.cancelled = items, False

    async def _fetch_future_result_async(self):
        return None

    def cancel(self):
        self.cancelled = True

    async def _gen(self):
        for item in self.items:
            await asyncio.sleep(0)
            yield item
        await asyncio.Event().wait()

    def __aiter__(self):
        return self._gen()


class _ChannelGone(_Call):
    async def _gen(self):
        await self.gone.wait()
        raise ConnectionError("the LLM replica's node went away")
        yield


class _Text:
    """TextRules' stand-in: each chunk is its own delta."""

    def processor(self, tokenizer):
        return SimpleNamespace(feed=lambda chunk: chunk)


def test_a_generation_whose_token_channel_is_lost_before_its_first_token_goes_once_more():
    """The LLM replica dies with a generation attached to its token channel, nothing sent yet: the channel's end
    reaches the ingress before the call's own (a race either may win). It is sent once more, to the replica the
    router picks now, as when the call's own stream reports the loss; not a 503 while a healthy replica remains."""

    async def go():
        channel = _ChannelGone([])
        channel.gone = asyncio.Event()
        calls = [_Call([Routed("r1", via_channel=True)]), _Call([Routed("r2", via_channel=False), TokenChunk([5])])]
        opened = {"r1": channel, "r2": _Call([])}
        llm = SimpleNamespace(
            generate=SimpleNamespace(remote=lambda request: calls.pop(0)),
            channel=SimpleNamespace(remote=lambda req: opened[req.replica_id]),
        )
        llm.options = lambda **_: llm
        hub = ChannelHub(llm, "ing")
        hub.open("r1")
        gen = Generator(None, llm, hub, SimpleNamespace(llm=SimpleNamespace(token_channel=True)), None)
        first = calls[0]
        params = [SamplingParams(max_tokens=4)]
        started = asyncio.ensure_future(gen._generate(Prepared(prompt=[1]), params, _Text(), [], "r", 0))
        while not hub.attached.get("r1"):  # the generation is on r1's channel, waiting for its first token
            await asyncio.sleep(0.01)
        channel.gone.set()
        streams, firsts = await asyncio.wait_for(started, 5)
        assert [d.token_ids for d in firsts] == [[5]] and gen.counts["llm_retries"] == 1 and first.cancelled
        await asyncio.gather(*(s.aclose() for s in streams))
        for task in hub.readers.values():
            task.cancel()

    asyncio.run(go())
