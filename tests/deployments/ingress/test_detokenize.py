"""Streaming detokenization keeps multi-byte characters whole; stop strings cut across chunk boundaries."""

from __future__ import annotations

import random

import pytest

from deployments.ingress.detokenize import IncrementalDetokenizer, OutputProcessor, StopMatcher, decoder
from deployments.ingress.prompt import load_tokenizer
from schemas import SamplingParams, TokenChunk, TokenLogprob

TEXTS = ["Hello, world!", "你好，世界", "emoji 🙂👍🏽 and (12,34)", "mixed ünïcödé ✓ text\nwith lines"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_incremental_equals_full_decode(checkpoint, text, step):
    tokenizer = load_tokenizer(checkpoint)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # never a half character on the wire


def test_special_tokens_are_not_text(checkpoint):
    tokenizer = load_tokenizer(checkpoint)
    ids = tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids) + detok.flush() == "hi"


@pytest.mark.parametrize(
    ("chunks", "stops", "expected"),
    [
        (["Hello wor", "ld, stop here"], ["world"], "Hello "),
        (["ab", "c", "STO", "P", "tail"], ["STOP"], "abc"),
        (["no stop in ", "this text"], ["zzz"], "no stop in this text"),
        (["two ", "stops: B then A"], ["A", "B"], "two stops: "),
        (["x"], [], "x"),
    ],
)
def test_stop_matcher(chunks, stops, expected):
    m = StopMatcher(stops)
    out = "".join(m.feed(c) for c in chunks) + m.flush()
    assert out == expected
    assert m.stopped == (expected != "".join(chunks))


class _Reference:
    """IncrementalDetokenizer as it was: both windows through tokenizer.decode on every chunk."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, ids):
        self.ids += ids
        prefix_text, new_text = self._decode(self.ids[self.prefix : self.read]), self._decode(self.ids[self.prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self):
        prefix_text, new_text = self._decode(self.ids[self.prefix : self.read]), self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return new_text[len(prefix_text) :]


@pytest.mark.parametrize("seed", range(4))
def test_random_ids_in_random_chunks_give_the_same_pieces_as_before(checkpoint, seed):
    """Any ids (special tokens, bytes that are no UTF-8), chunked anyhow: the same pieces as the decode-everything
    version, in the same chunks."""
    tokenizer, rng = load_tokenizer(checkpoint), random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(300)]
    new, old = IncrementalDetokenizer(tokenizer), _Reference(tokenizer)
    at = 0
    while at < len(ids):
        step = rng.choice([1, 1, 1, 2, 5])
        assert new.add(ids[at : at + step]) == old.add(ids[at : at + step])
        at += step
    assert new.flush() == old.flush()


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decoder_is_the_tokenizers_decode(checkpoint, skip_special_tokens):
    tokenizer, rng = load_tokenizer(checkpoint), random.Random(0)
    decode = decoder(tokenizer, skip_special_tokens)
    for n in (0, 1, 2, 7, 40):
        ids = [rng.randrange(len(tokenizer)) for _ in range(n)]
        assert decode(ids) == tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )


def test_without_stop_strings_the_text_passes_straight_through():
    m = StopMatcher([])
    assert [m.feed(t) for t in ["a", "", "bc"]] == ["a", "", "bc"] and m.flush() == "" and not m.stopped


def _old_stop_matcher(stops: list[str], chunks: list[str]) -> list[str]:
    """StopMatcher as it was (a find per stop string), fed `chunks` and flushed: what it sent each time."""
    hold, buffer, stopped, out = max((len(s) for s in stops), default=1) - 1, "", False, []
    for text in chunks:
        if stopped:
            out.append("")
            continue
        buffer += text
        hits = [i for i in (buffer.find(s) for s in stops) if i >= 0]
        if hits:
            out.append(buffer[: min(hits)])
            buffer, stopped = "", True
        else:
            cut = max(len(buffer) - hold, 0)
            out.append(buffer[:cut])
            buffer = buffer[cut:]
    return out + ["" if stopped else buffer]


@pytest.mark.parametrize("seed", range(20))
def test_stop_matcher_sends_what_it_sent_before(seed):
    """Random texts over a small alphabet (so that stops hit, overlap and span chunks), random stops, any chunks."""
    rng = random.Random(seed)
    text = "".join(rng.choice("ab c.") for _ in range(rng.randrange(0, 60)))
    stops = ["".join(rng.choice("ab c.") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(0, 4))]
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(1, 12))))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    m = StopMatcher(stops)
    assert [m.feed(c) for c in chunks] + [m.flush()] == _old_stop_matcher(stops, chunks)


@pytest.mark.parametrize("step", [1, 3, 100])
def test_a_stop_string_ends_the_tokens_at_the_one_that_completed_it(checkpoint, step):
    """Chunks carry several tokens (fast chunks, coalescing): the ones after the stop string's are not the answer's,
    in token_ids and logprobs alike (they became grounding boxes past a stop once)."""
    tokenizer = load_tokenizer(checkpoint)
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in ("the star", "(", "12,34),(56,78)")]
    head, stop_token, tail = ids[0], ids[1], ids[2]
    assert len(stop_token) == 1
    answer = head + stop_token + tail
    out, deltas = OutputProcessor(tokenizer, SamplingParams(99, stop=("(",))), []
    for i in range(0, len(answer), step):
        part = answer[i : i + step]
        logprobs = [TokenLogprob(-float(t), []) for t in part]  # each names its token
        deltas.append(out.feed(TokenChunk(part, "length" if i + step >= len(answer) else None, logprobs)))
        if deltas[-1].finish_reason is not None:
            break
    assert "".join(d.text for d in deltas) == "the star" and deltas[-1].finish_reason == "stop"
    assert [t for d in deltas for t in d.token_ids] == head + stop_token
    assert [-lp.logprob for d in deltas for lp in d.logprobs] == head + stop_token


@pytest.mark.parametrize(
    ("chunks", "stops", "expected"),
    [
        (["Hello wor", "ld, stop here"], ["world"], "Hello world"),
        (["ab", "c", "STO", "P", "tail"], ["STOP"], "abcSTOP"),
        (["no stop in ", "this text"], ["zzz"], "no stop in this text"),
        (["two ", "stops: B then A"], ["A", "B"], "two stops: B"),
    ],
)
def test_stop_matcher_includes_the_stop_string_when_asked(chunks, stops, expected):
    m = StopMatcher(stops, include=True)
    assert "".join(m.feed(c) for c in chunks) + m.flush() == expected


@pytest.mark.parametrize("seed", range(20))
def test_included_stop_strings_add_the_match_to_the_same_cut(seed):
    """Random texts, stops and chunks: with include_stop_str_in_output the text is the one without it, plus the stop
    string that ended it; and nothing is held back (each chunk's text goes out at once until a match)."""
    rng = random.Random(seed)
    text = "".join(rng.choice("ab c.") for _ in range(rng.randrange(0, 60)))
    stops = ["".join(rng.choice("ab c.") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(1, 12))))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    cut, kept = StopMatcher(stops), StopMatcher(stops, include=True)
    without = "".join(cut.feed(c) for c in chunks) + cut.flush()
    sent, with_stop = "", ""
    for c in chunks:
        with_stop += kept.feed(c)
        sent += c
        assert kept.stopped or with_stop == sent
    with_stop += kept.flush()
    assert cut.stopped == kept.stopped
    if cut.stopped:
        assert with_stop.startswith(without) and with_stop[len(without) :] in stops
    else:
        assert with_stop == without == text


def _one_token_chunks(tokenizer, pieces: list[str], finish: str = "length") -> list[TokenChunk]:
    ids = [i for p in pieces for i in tokenizer.encode(p, add_special_tokens=False)]
    return [TokenChunk([t], finish if n == len(ids) - 1 else None) for n, t in enumerate(ids)]


@pytest.mark.parametrize("step", [1, 100])
def test_stop_strings_wait_for_min_tokens(checkpoint, step):
    """As vLLM: a stop string completed by one of the first min_tokens tokens does not end the text, even while it
    still lies in the held-back tail when min_tokens is reached; one completed later does."""
    tokenizer = load_tokenizer(checkpoint)
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in ("the star", "(", "12", "(", "56")]
    assert len(ids[1]) == len(ids[3]) == 1
    flat = [i for t in ids for i in t]
    n_before = len(ids[0]) + 1  # up to and including the first "("

    def run(min_tokens: int) -> str:
        out = OutputProcessor(
            tokenizer, SamplingParams(99, stop=("(", "zzzzz"), min_tokens=min_tokens)
        )  # a long stop: a long tail held
        text = ""
        for i in range(0, len(flat), step):
            delta = out.feed(TokenChunk(flat[i : i + step], "length" if i + step >= len(flat) else None))
            text += delta.text
            if delta.finish_reason is not None:
                break
        return text

    assert run(0) == "the star"
    assert run(n_before) == "the star(12"  # the first "(" came with token n_before: not yet armed
    assert run(n_before - 1) == "the star"


def test_the_stop_tokens_text_is_left_out_unless_included(checkpoint):
    """A stop_token_ids token that is plain text ends the answer without its text (vLLM's detokenizer), and with
    include_stop_str_in_output keeps it; with skip_special_tokens false, special tokens are text, and so is the
    closing EOS when included."""
    tokenizer = load_tokenizer(checkpoint)
    say = tokenizer.encode("ok.", add_special_tokens=False)
    box = tokenizer.convert_tokens_to_ids("<|box_start|>")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def text(ids, **kw) -> str:
        out = OutputProcessor(tokenizer, SamplingParams(99, **kw))
        return "".join(out.feed(TokenChunk([t], "stop" if n == len(ids) - 1 else None)).text for n, t in enumerate(ids))

    assert text(say) == "ok" and text(say, include_stop_str_in_output=True) == "ok."
    assert text([*say[:-1], box, eos]) == "ok"
    assert text([*say[:-1], box, eos], skip_special_tokens=False) == "ok<|box_start|>"
    assert (
        text([*say[:-1], box, eos], skip_special_tokens=False, include_stop_str_in_output=True)
        == "ok<|box_start|><|im_end|>"
    )
    # a finish that is no stop token (max_tokens) keeps the last token's text
    out = OutputProcessor(tokenizer, SamplingParams(99))
    assert "".join(out.feed(TokenChunk([t], "length" if t == say[-1] else None)).text for t in say) == "ok."
