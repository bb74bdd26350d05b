"""Token ids back to text as they stream: multi-byte characters stay whole, stop strings cut the text."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from schemas import FinishReason, TokenChunk, TokenLogprob


def decoder(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`, calling the
    Rust tokenizer directly where that is all `decode` does (a fast tokenizer whose class keeps transformers'
    decode): transformers' per-call Python work is most of the cost of decoding a token or two."""
    cls = type(tokenizer)
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerFast.decode
        and cls._decode is PreTrainedTokenizerFast._decode
    ):
        backend = tokenizer.backend_tokenizer
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


class IncrementalDetokenizer:
    """Emits only text that can no longer change: a partial UTF-8 character (U+FFFD at the end) waits."""

    # The prefix/read offsets idea follows text-generation-inference's incremental decoding.
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self._decode = decoder(tokenizer, skip_special_tokens=True)
        self.token_ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # end of the text already emitted
        self._prefix_text = ""  # the decoded window token_ids[_prefix:_read], kept while the offsets stay

    def add(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        new_text = self._decode(self.token_ids[self._prefix :])
        if len(new_text) > len(self._prefix_text) and not new_text.endswith("\ufffd"):
            out = new_text[len(self._prefix_text) :]
            self._prefix, self._read = self._read, len(self.token_ids)
            self._prefix_text = self._decode(self.token_ids[self._prefix : self._read])
            return out
        return ""

    def flush(self) -> str:
        """What is left at the end of the stream, incomplete characters included."""
        new_text = self._decode(self.token_ids[self._prefix :])
        out = new_text[len(self._prefix_text) :]
        self._prefix = self._read = len(self.token_ids)
        self._prefix_text = ""
        return out


class StopMatcher:
    """Holds back just enough text to see a stop string that spans chunks; cuts before the first match."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        # One search for all the stop strings: the leftmost match of the alternation is the first of them.
        self._pattern = re.compile("|".join(map(re.escape, stops))) if stops else None
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._buffer = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that is now safe to send. Only the held-back tail and `text` are searched: the buffer never
        keeps more than the longest stop string less one character."""
        if self._pattern is None:
            return text
        if self.stopped:
            return ""
        buffer = self._buffer + text
        hit = self._pattern.search(buffer)
        if hit is not None:
            self._buffer, self.stopped = "", True
            return buffer[: hit.start()]
        cut = len(buffer) - self._hold
        if cut <= 0:
            self._buffer = buffer
            return ""
        self._buffer = buffer[cut:]
        return buffer[:cut]

    def flush(self) -> str:
        out, self._buffer = ("" if self.stopped else self._buffer), ""
        return out


@dataclass(slots=True)
class TextDelta:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None
    num_cached_tokens: int | None = None  # on a choice's first delta: its prompt tokens from the prefix cache


class OutputProcessor:
    """One choice's token chunks -> text deltas: incremental text, stop strings, the finish reason."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: list[str]):
        self.detok, self.stop = IncrementalDetokenizer(tokenizer), StopMatcher(stops)

    def feed(self, chunk: TokenChunk) -> TextDelta:
        ids, logprobs = chunk.token_ids, chunk.logprobs
        if self.stop.stops and len(ids) > 1:
            # A token at a time: a stop string ends the choice at the token that completed it, so the tokens the
            # engine made after it in the same chunk (token_ids, logprobs, usage, grounding boxes) are not the
            # answer's. As vLLM: the completion's tokens run up to and including that token.
            text = ""
            for i, token in enumerate(ids):
                text += self.stop.feed(self.detok.add([token]))
                if self.stop.stopped:
                    ids, logprobs = ids[: i + 1], logprobs[: i + 1] if logprobs is not None else None
                    break
        else:
            text = self.stop.feed(self.detok.add(ids))
        if chunk.finish_reason is not None and not self.stop.stopped:
            text += self.stop.feed(self.detok.flush())
            text += self.stop.flush()
        finish = "stop" if self.stop.stopped else chunk.finish_reason
        return TextDelta(text, ids, finish, logprobs, chunk.num_cached_tokens)


__all__ = ["IncrementalDetokenizer", "OutputProcessor", "StopMatcher", "TextDelta", "decoder"]
