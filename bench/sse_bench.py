"""The ingress's per-token work, each against the way it was done before (`python -m bench.sse_bench`).

1. One content delta to its SSE event: the old path (pydantic models, `model_dump_json`; copied below as the
   baseline) against `deployments.ingress.responses.ContentChunks` (head encoded once, msgspec for the rest), for a
   1-token delta as most are, then with `return_token_ids`, then with logprobs (top 5). Also the JSON encoders
   for the delta's text alone, to show why msgspec (orjson's row only where it is installed).
2. Token ids to sendable text, one token per chunk as the engine sends them, over a 4,000-character answer: the
   old `IncrementalDetokenizer` + `StopMatcher` (copied below) against ingress/detokenize.py's, with no stop strings
   and with two. `tokenizers`' own `DecodeStream` is a row for reference, not used: it has no flush of the ids it
   holds back, and it raises (InvalidPrefix) where a window's text does not start with the shorter window's,
   which byte-fallback tokenizers can do.

Medians of repeated timings taken round-robin over the cases, so a burst of other load hits them alike. Prints a
markdown table, microseconds per delta or token, with old/new.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import timeit
from collections.abc import Callable
from pathlib import Path

import msgspec
from transformers import PreTrainedTokenizerBase

from deployments.ingress.detokenize import IncrementalDetokenizer, StopMatcher
from deployments.ingress.http import sse
from deployments.ingress.prompt import load_tokenizer
from deployments.ingress.responses import ContentChunks, logprob_items
from schemas import TokenLogprob
from schemas.openai import ChatCompletionChunk, ChoiceLogprobs, ChunkChoice, Delta, TokenLogprobOut, TopLogprob

DEMO = Path(__file__).parents[1] / "demo" / "qwen2-vl-shapes"
HEAD = {"id": "chatcmpl-5f0c6a0e8d9b4c2a9e1f3b7d6a8c4e21", "created": 1_700_000_000, "model": "qwen2-vl-shapes"}
ANSWER = ("The red circle is at the top left, (12,34),(56,78); the blue square 你好 is below it 🙂. " * 40)[:4000]
STOPS = ["</answer>", "Observation:"]


# ---- baseline: the code as it was before this change (ingress/responses.py, ingress/detokenize.py) ----


def old_to_logprobs(tokenizer: PreTrainedTokenizerBase, ids: list[int], lps: list[TokenLogprob] | None):
    if lps is None:
        return None

    def piece(token_id: int, logprob: float) -> TopLogprob:
        text = tokenizer.decode([token_id])
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    return ChoiceLogprobs(
        content=[
            TokenLogprobOut(**piece(t, lp.logprob).model_dump(), top_logprobs=[piece(i, v) for i, v in lp.top])
            for t, lp in zip(ids, lps, strict=True)
        ]
    )


def old_content_event(tokenizer, head: dict, i: int, text: str, ids: list[int], lps, ids_out: bool) -> str:
    return sse(
        ChatCompletionChunk(
            **head,
            choices=[
                ChunkChoice(
                    index=i,
                    delta=Delta(content=text),
                    token_ids=ids if ids_out else None,
                    logprobs=old_to_logprobs(tokenizer, ids, lps),
                )
            ],
        )
    )


class OldDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer, self.token_ids, self._prefix, self._read = tokenizer, [], 0, 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.token_ids[self._prefix : self._read])
        new_text = self._decode(self.token_ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.token_ids)
            return new_text[len(prefix_text) :]
        return ""


class OldStopMatcher:
    def __init__(self, stops: list[str]):
        self.stops, self._buffer, self.stopped = stops, "", False
        self._hold = max((len(s) for s in stops), default=1) - 1

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self._buffer += text
        hits = [i for i in (self._buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self._buffer, self.stopped = self._buffer[: min(hits)], "", True
            return out
        cut = len(self._buffer) - self._hold
        if cut <= 0:
            return ""
        out, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return out


# ---- the cases ----


def _per_call(fn: Callable[[], object], number: int) -> float:
    """Microseconds per call of `fn`, one timing of `number` calls."""
    return timeit.timeit(fn, number=number) / number * 1e6


def chunk_cases(tokenizer) -> list[tuple[str, Callable[[], object], Callable[[], object], int]]:
    """(name, old, new, calls per timing) for one content delta."""
    t = tokenizer.encode(" circle", add_special_tokens=False)[:1]
    text = tokenizer.decode(t)
    lps = [TokenLogprob(-0.25, [(t[0] + k, -0.25 - k) for k in range(5)])]
    new = ContentChunks(HEAD)
    for ids_out, lp in ((True, lps), (False, None)):  # the same JSON, or there is nothing to compare
        old_ev = old_content_event(tokenizer, HEAD, 0, text, t, lp, ids_out)
        new_ev = new.content(0, text, t if ids_out else None, None if lp is None else logprob_items(tokenizer, t, lp))
        assert json.loads(old_ev[6:]) == json.loads(new_ev[6:]), (old_ev, new_ev)
    return [
        (
            "content delta, 1 token",
            lambda: old_content_event(tokenizer, HEAD, 0, text, t, None, False),
            lambda: new.content(0, text),
            20000,
        ),
        (
            "  + return_token_ids",
            lambda: old_content_event(tokenizer, HEAD, 0, text, t, None, True),
            lambda: new.content(0, text, t),
            20000,
        ),
        (
            "  + logprobs, top 5",
            lambda: old_content_event(tokenizer, HEAD, 0, text, t, lps, False),
            lambda: new.content(0, text, None, logprob_items(tokenizer, t, lps)),
            3000,
        ),
    ]


def encoder_cases(text: str) -> list[tuple[str, Callable[[], object], Callable[[], object], int]]:
    """The delta text's JSON, the encoder call alone (json_text wraps msgspec's): json.dumps and orjson (where
    installed) against msgspec."""
    encode = msgspec.json.Encoder().encode
    cases = [
        (
            "text JSON: json.dumps vs msgspec",
            lambda: json.dumps(text, ensure_ascii=False),
            lambda: encode(text).decode(),
            50000,
        )
    ]
    try:
        import orjson
    except ImportError:
        return cases
    return cases + [
        ("text JSON: orjson vs msgspec", lambda: orjson.dumps(text).decode(), lambda: encode(text).decode(), 50000)
    ]


def detok_cases(tokenizer) -> list[tuple[str, Callable[[], object], Callable[[], object], int]]:
    """Whole answers, one token per chunk; the timing is divided by the answer's tokens below."""
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)

    def run(detok_cls, stop_cls, stops) -> str:
        detok, stop = detok_cls(tokenizer), stop_cls(stops)
        return "".join([stop.feed(detok.add([t])) for t in ids])

    for stops in ([], STOPS):
        assert run(OldDetokenizer, OldStopMatcher, stops) == run(IncrementalDetokenizer, StopMatcher, stops)
    cases = [
        (
            "detokenize, no stop strings",
            lambda: run(OldDetokenizer, OldStopMatcher, []),
            lambda: run(IncrementalDetokenizer, StopMatcher, []),
            1,
        ),
        (
            "detokenize + 2 stop strings",
            lambda: run(OldDetokenizer, OldStopMatcher, STOPS),
            lambda: run(IncrementalDetokenizer, StopMatcher, STOPS),
            1,
        ),
    ]
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return cases
    backend = tokenizer.backend_tokenizer

    def stream() -> str:
        s = DecodeStream(skip_special_tokens=True)
        return "".join([x for t in ids if (x := s.step(backend, t)) is not None])

    return cases + [
        ("  (reference: tokenizers' DecodeStream)", lambda: run(OldDetokenizer, OldStopMatcher, []), stream, 1)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15, help="timings per case, taken round-robin (median kept)")
    args = ap.parse_args()
    tokenizer = load_tokenizer(DEMO)
    n_tokens = len(tokenizer.encode(ANSWER, add_special_tokens=False))
    rows = [(c, 1) for c in chunk_cases(tokenizer) + encoder_cases(" circle")]
    rows += [(c, n_tokens) for c in detok_cases(tokenizer)]
    times: dict[str, tuple[list[float], list[float]]] = {c[0]: ([], []) for c, _ in rows}
    for _ in range(args.rounds):
        for (name, old, new, number), per in rows:
            times[name][0].append(_per_call(old, number) / per)
            times[name][1].append(_per_call(new, number) / per)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M')}, {tokenizer.name_or_path}: {n_tokens}-token answer for the "
        f"detokenizer rows; medians of {args.rounds} round-robin timings\n"
    )
    print("| per delta or token | old µs | new µs | old/new |\n|---|---:|---:|---:|")
    for (name, *_), _per in rows:
        old, new = (statistics.median(t) for t in times[name])
        print(f"| {name} | {old:.2f} | {new:.2f} | {old / new:.1f}x |")


if __name__ == "__main__":
    main()
