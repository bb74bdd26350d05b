"""Streaming detokenization keeps multi-byte characters whole; stop strings cut across chunk boundaries."""

from __future__ import annotations

import pytest

from llm import IncrementalDetokenizer, StopMatcher, load_tokenizer

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
