"""Generator, without Ray, through the handles it is given (fakes of the Encoder's and the LLM's): a prompt's images
go to the encoder tier in as few calls as one ViT forward each takes, those in the embedding cache in none; the LLM
is sent each item's record and the calls' refs; images lost on the way are encoded once more, each at most once; a
text completion's prompts start at once, their choices numbered prompt by prompt, and when one prompt fails the
generations the others started are closed (cancelled), not leaked; a generation whose LLM replica was lost before
its first token goes once more."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from deployments.channel import ChannelHub, Routed
from deployments.ingress.generate import Generator
from deployments.ingress.prepare import Prepared
from schemas import AppArgs, EncoderUnavailable, InvalidRequest, MediaItem, Overloaded, SamplingParams, TokenChunk

ROW_BYTES = 256  # what one embedding row counts against the cache


class _Assigned:
    """An encoder call: its ObjectRef once a replica took it (`ref`: a value, or a future the test completes)."""

    def __init__(self, ref):
        self.ref, self.cancelled = ref, False

    async def _to_object_ref(self):
        return await self.ref if isinstance(self.ref, asyncio.Future) else self.ref

    def cancel(self):
        self.cancelled = True


class FakeEncoder:
    """The Encoder's handle: each call's ref is a string naming the call and its jobs."""

    def __init__(self):
        self.calls: list[tuple[list[bytes], float]] = []
        self.sent: list[_Assigned] = []
        self.encode = SimpleNamespace(remote=self._remote)

    def _remote(self, jobs, cost=None):
        self.calls.append((list(jobs), cost))
        self.sent.append(_Assigned(f"call{len(self.calls) - 1}:" + ",".join(j.decode() for j in jobs)))
        return self.sent[-1]


class _Call:
    """A Serve streaming call (already taken by a replica): yields `items` (raises one that is an exception), then
    stays open (its end not yet seen)."""

    def __init__(self, items):
        self.items, self.cancelled = items, False

    async def _fetch_future_result_async(self):
        return None

    def cancel(self):
        self.cancelled = True

    async def _gen(self):
        for item in self.items:
            await asyncio.sleep(item if isinstance(item, float) else 0)  # a number: a pause before what follows
            if isinstance(item, BaseException):
                raise item
            if not isinstance(item, float):
                yield item
        await asyncio.Event().wait()

    def __aiter__(self):
        return self._gen()


class FakeLLM:
    """The LLM's handle: records each generation (its request and media); `answer(request, media)` gives what its
    stream yields (default: one chunk carrying the choice's number, from the request id)."""

    def __init__(self, answer=None):
        self.sent: list[tuple] = []
        self.calls: list[_Call] = []
        self.answer = answer or (lambda request, media: [TokenChunk([int(request.request_id.rsplit("-", 1)[1])])])
        self.generate = SimpleNamespace(remote=self._remote)
        self.channel = SimpleNamespace(remote=lambda req: _Call([]))

    def options(self, **_):
        return self

    def _remote(self, request, media):
        self.sent.append((request, media))
        self.calls.append(_Call(self.answer(request, media)))
        return self.calls[-1]


class _Tokenizer:
    """A tokenizer whose text of a token is its id, and a space."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(f"{i} " for i in ids)


@pytest.fixture(autouse=True)
def _model_dir(tmp_path, monkeypatch):
    """AppArgs wants a checkpoint directory; the Generator reads nothing from it."""
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)


def _generator(encoder=None, llm=None, cache_gib: float = 0.0, max_batch_patches: int = 100, channel=False):
    args = AppArgs(
        model=".",
        encoder={"cache_gib": cache_gib, "max_batch_patches": max_batch_patches, "timeout_s": 30},
        llm={"token_channel": channel},
    )
    llm = llm or FakeLLM()
    return Generator(encoder, llm, ChannelHub(llm, "ing"), args, _Tokenizer(), embedding_row_bytes=ROW_BYTES), llm


def _image(name: str, patches: int = 40, tokens: int = 10) -> MediaItem:
    grid = (1, 2, patches // 2)
    return MediaItem(f"key-{name}", grid, tokens, 7, number=0, cost=1.0, patches=patches, data=name.encode())


def _video(name: str, chunks: int) -> MediaItem:
    parts = tuple(
        MediaItem(f"key-{name}@{k}", (1, 2, 20), 10, 8, cost=1.0, patches=40, data=f"{name}{k}".encode())
        for k in range(chunks)
    )
    return MediaItem(
        f"key-{name}", (chunks, 2, 20), 10 * chunks, 8, 0.5, cost=chunks, patches=40 * chunks, chunks=parts
    )


def _start(gen: Generator, items: list[MediaItem], n: int = 1):
    async def run():
        streams, firsts = await gen.start(Prepared(prompt=[1], items=items), [SamplingParams(1)] * n, "r")
        await asyncio.gather(*(s.aclose() for s in streams))
        return firsts

    return asyncio.run(run())


def test_images_go_in_calls_of_one_forward_and_the_llm_gets_their_records():
    encoder = FakeEncoder()
    gen, llm = _generator(encoder, max_batch_patches=100)  # two images of 40 patches a call
    items = [_image("a"), _image("b"), _image("c"), _video("v", chunks=2)]
    _start(gen, items, n=2)
    assert [jobs for jobs, _ in encoder.calls] == [[b"a", b"b"], [b"c", b"v0"], [b"v1"]]
    assert [cost for _, cost in encoder.calls] == [2.0, 2.0, 1.0]
    (request, media), (request1, media1) = llm.sent  # the two choices: the same items and refs
    assert media == media1 == ["call0:a,b", "call1:c,v0", "call2:v1"]
    assert [item.pieces for item in request.items] == [((0, 0),), ((0, 1),), ((1, 0),), ((1, 1), (2, 0))]
    assert [item.key for item in request.items] == ["key-a", "key-b", "key-c", "key-v"]  # the video's, not chunks'
    assert request.items[3].num_tokens == 20 and request.items[3].second_per_grid_t == 0.5
    assert [item.placeholder_id for item in request.items] == [7, 7, 7, 8]
    # the same record the ingress made, without the bytes (an encoder has them) or the video's chunks (its pieces)
    assert all(item.data is None and item.chunks == () for item in request.items) and items[0].data == b"a"
    assert request1.items == request.items and request.request_id != request1.request_id


def test_colocated_sends_each_items_bytes_to_the_llm():
    gen, llm = _generator(encoder=None)
    _start(gen, [_image("a"), _image("b")])
    [(request, media)] = llm.sent
    assert media == [b"a", b"b"] and all(item.pieces == () and item.data is None for item in request.items)


def test_a_cache_hit_makes_no_encoder_call_and_sends_the_first_ref():
    encoder = FakeEncoder()
    gen, llm = _generator(encoder, cache_gib=1)
    _start(gen, [_image("a"), _image("b")])
    _start(gen, [_image("b"), _image("c")])  # b is a hit; c alone goes to the encoder
    assert [jobs for jobs, _ in encoder.calls] == [[b"a", b"b"], [b"c"]]
    (_, first), (second, media) = llm.sent
    assert media == ["call0:a,b", "call1:c"] and first == ["call0:a,b"]
    assert [item.pieces for item in second.items] == [((0, 1),), ((1, 0),)]  # b: position 1 of the first call
    stats = gen.cache.stats()
    assert (stats["hits"], stats["misses"], stats["objects"]) == (1, 3, 2)
    assert stats["bytes"] == (20 + 10) * ROW_BYTES  # each call's object counted once, whole


def test_a_failed_request_leaves_nothing_in_the_cache():
    """Its calls were cancelled, or hold an error: a later request with the same images encodes them again."""
    encoder = FakeEncoder()
    gen, llm = _generator(encoder, cache_gib=1, llm=FakeLLM(lambda r, m: [InvalidRequest("image 1: not an image")]))
    with pytest.raises(InvalidRequest, match="not an image"):
        _start(gen, [_image("a"), _image("b")])
    assert all(call.cancelled for call in encoder.sent) and gen.cache.stats()["entries"] == 0
    gen.llm.answer = lambda request, media: [TokenChunk([0])]
    _start(gen, [_image("a")])
    assert len(encoder.calls) == 2


def _losing(lost: list[list[str]]):
    """An LLM that, for each list in `lost`, fails once with EncoderUnavailable naming the calls whose refs are those
    (by the call's jobs), then answers."""

    def answer(request, media):
        if lost:
            names = lost.pop(0)
            calls = [c for c, ref in enumerate(media) if ref.split(":")[1] in names]
            return [EncoderUnavailable(f"lost {names}", calls)]
        return [TokenChunk([0])]

    return FakeLLM(answer)


def test_each_lost_image_is_encoded_once_more_as_it_fails():
    """The LLM reports a lost call as soon as it fails: a second one lost later is retried too; the cache forgets
    the lost calls and keeps the new ones."""
    encoder = FakeEncoder()
    gen, llm = _generator(encoder, cache_gib=1, llm=_losing([["b"], ["c"]]), max_batch_patches=40)
    _start(gen, [_image("a"), _image("b"), _image("c")])
    assert [jobs for jobs, _ in encoder.calls] == [[b"a"], [b"b"], [b"c"], [b"b"], [b"c"]]
    assert llm.sent[-1][1] == ["call0:a", "call3:b", "call4:c"]
    assert gen.counts["encoder_retries"] == 2 and gen.counts["encoder_failures"] == 0
    assert gen.cache.get("key-b")[0] == "call3:b" and gen.cache.stats()["objects"] == 3


def test_an_image_lost_twice_is_a_503():
    encoder = FakeEncoder()
    gen, _ = _generator(encoder, llm=_losing([["b"], ["b"]]), max_batch_patches=40)
    with pytest.raises(Overloaded, match="image encoding failed twice"):
        _start(gen, [_image("a"), _image("b")])
    assert gen.counts["encoder_retries"] == 1 and gen.counts["encoder_failures"] == 1


def test_an_image_lost_with_others_in_its_call_reencodes_the_call():
    encoder = FakeEncoder()
    gen, llm = _generator(encoder, llm=_losing([["a,b"]]))
    _start(gen, [_image("a"), _image("b")])
    assert [jobs for jobs, _ in encoder.calls] == [[b"a", b"b"], [b"a", b"b"]] and gen.counts["encoder_retries"] == 2


@pytest.mark.parametrize("turns", range(8))
def test_a_request_cancelled_as_its_images_are_assigned_stays_cancelled(turns):
    """Serve cancels a request's calls, then the request (direct ingress, the client gone): the images' refs complete
    a few turns of the loop before the cancellation reaches the waiting request. Whatever the turn, the request ends
    cancelled or generates; with asyncio.wait_for (Python 3.11) one of these turns returned the refs and the request
    went on to generate for nobody."""

    async def run():
        ref = asyncio.get_running_loop().create_future()
        encoder = FakeEncoder()
        encoder.encode = SimpleNamespace(remote=lambda *a, **k: _Assigned(ref))
        gen, llm = _generator(encoder)
        p = Prepared(prompt=[1], items=[_image("a"), _image("b")])
        waiting = asyncio.ensure_future(gen.start(p, [SamplingParams(1)], "r"))
        await asyncio.sleep(0.01)
        ref.set_result("ref")
        for _ in range(turns):
            await asyncio.sleep(0)
        sent_first = bool(llm.sent)  # then it had its refs before the cancellation
        waiting.cancel()
        try:
            await waiting
            return sent_first, "generated"
        except asyncio.CancelledError:
            return sent_first, "cancelled"

    sent_first, outcome = asyncio.run(run())
    assert outcome == "cancelled" or sent_first


def test_choices_are_numbered_prompt_by_prompt():
    gen, _ = _generator()

    async def run():
        prompts = [Prepared(prompt=[k]) for k in range(3)]
        streams, firsts = await gen.start_all(prompts, [[SamplingParams(1)] * 2] * 3, "r")
        await asyncio.gather(*(s.aclose() for s in streams))
        return firsts

    assert [d.token_ids for d in asyncio.run(run())] == [[0], [1], [2], [3], [4], [5]]


def test_each_choice_s_text_follows_its_sampling_params():
    """The text rules travel in SamplingParams: a stop string ends the choice at the token that completed it (the
    rest of its chunk dropped, the generation cancelled); min_tokens defers it; a choice without one runs on."""
    llm = FakeLLM(lambda request, media: [TokenChunk([1, 2]), TokenChunk([3, 4, 5]), TokenChunk([6], "length")])
    gen, _ = _generator(llm=llm)
    params = [SamplingParams(9, stop=("3",)), SamplingParams(9, stop=("3",), min_tokens=4), SamplingParams(9)]

    async def run():
        streams, firsts = await gen.start(Prepared(prompt=[1]), params, "r")
        rest = [[d async for d in s] for s in streams]
        return [[first, *more] for first, more in zip(firsts, rest, strict=True)]

    choices = asyncio.run(run())
    texts = [["".join(d.text for d in c), [t for d in c for t in d.token_ids], c[-1].finish_reason] for c in choices]
    assert texts[0] == ["1 2 ", [1, 2, 3], "stop"]
    assert texts[1] == ["1 2 3 4 5 6 ", [1, 2, 3, 4, 5, 6], "length"]  # "3" came before min_tokens
    assert texts[2] == ["1 2 3 4 5 6 ", [1, 2, 3, 4, 5, 6], "length"]
    assert llm.calls[0].cancelled and not llm.calls[2].cancelled


@pytest.mark.parametrize("slow", [None, 0, 2])
def test_one_failing_prompt_closes_what_the_others_started(slow):
    """Whether the others started before the failure or were still starting (then cancelled), nothing stays open:
    every generation's call is cancelled."""

    def answer(request, media):
        if request.prompt_token_ids == [1]:
            return [InvalidRequest("prompt 1 is bad")]
        return [0.05 if request.prompt_token_ids == [slow] else 0.0, TokenChunk([0])]

    gen, llm = _generator(llm=FakeLLM(answer))
    with pytest.raises(InvalidRequest, match="prompt 1 is bad"):
        asyncio.run(gen.start_all([Prepared(prompt=[k]) for k in range(3)], [[SamplingParams(1)] * 2] * 3, "r"))
    assert len(llm.calls) == 6 and all(call.cancelled for call in llm.calls)


class _ChannelGone(_Call):
    async def _gen(self):
        await self.gone.wait()
        raise ConnectionError("the LLM replica's node went away")
        yield


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
            generate=SimpleNamespace(remote=lambda request, media: calls.pop(0)),
            channel=SimpleNamespace(remote=lambda req: opened[req.replica_id]),
        )
        llm.options = lambda **_: llm
        gen, _ = _generator(llm=llm, channel=True)
        gen.hub.open("r1")
        first = calls[0]
        started = asyncio.ensure_future(gen.start(Prepared(prompt=[1]), [SamplingParams(4)], "r"))
        while not gen.hub.attached.get("r1"):  # the generation is on r1's channel, waiting for its first token
            await asyncio.sleep(0.01)
        channel.gone.set()
        streams, firsts = await asyncio.wait_for(started, 5)
        assert [d.token_ids for d in firsts] == [[5]] and gen.counts["llm_retries"] == 1 and first.cancelled
        await asyncio.gather(*(s.aclose() for s in streams))
        for task in gen.hub.readers.values():
            task.cancel()

    asyncio.run(go())
