"""Token ids back to text as they stream: multi-byte characters stay whole, stop strings cut the text."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from schemas import FinishReason, TokenChunk, TokenLogprob


class IncrementalDetokenizer:
    """Emits only text that can no longer change: a partial UTF-8 character (U+FFFD at the end) waits."""

    # The prefix/read offsets idea follows text-generation-inference's incremental decoding.
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # end of the text already emitted

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

    def flush(self) -> str:
        """What is left at the end of the stream, incomplete characters included."""
        prefix_text = self._decode(self.token_ids[self._prefix : self._read])
        new_text = self._decode(self.token_ids[self._prefix :])
        self._prefix = self._read = len(self.token_ids)
        return new_text[len(prefix_text) :]


class StopMatcher:
    """Holds back just enough text to see a stop string that spans chunks; cuts before the first match."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._buffer = ""
        self.stopped = False

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
        text = self.stop.feed(self.detok.add(chunk.token_ids))
        if chunk.finish_reason is not None and not self.stop.stopped:
            text += self.stop.feed(self.detok.flush())
            text += self.stop.flush()
        finish = "stop" if self.stop.stopped else chunk.finish_reason
        return TextDelta(text, chunk.token_ids, finish, chunk.logprobs, chunk.num_cached_tokens)


__all__ = ["IncrementalDetokenizer", "OutputProcessor", "StopMatcher", "TextDelta"]
