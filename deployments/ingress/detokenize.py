"""Token ids back to text as they stream: multi-byte characters stay whole, stop strings cut the text (or end it,
with `include_stop_str_in_output`), special tokens skipped or not (`skip_special_tokens`), as vLLM's detokenizer."""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from schemas import SamplingParams, TokenChunk


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
    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self._decode = decoder(tokenizer, skip_special_tokens)
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
    """Holds back just enough text to see a stop string that spans chunks; cuts before the first match, or after it
    with `include` (then nothing needs holding back: the text before a match is sent either way)."""

    def __init__(self, stops: list[str], include: bool = False):
        self.stops, self.include = stops, include
        self._hold = max((len(s) for s in stops), default=1) - 1  # a match may start this far back
        self._buffer = ""  # the last `_hold` characters seen, the context of the next search
        self._sent = 0  # how many of them were sent already (with `include`)
        self.stopped = False

    def _first_match(self, text: str, new_from: int) -> tuple[int, int] | None:
        """(start, end) of the leftmost stop string in `text` that ends after `new_from` (in the new text; one that
        ended before was either found then or ended before the matcher was armed), the first listed on a tie."""
        best = None
        for stop in self.stops:
            i = text.find(stop, max(0, new_from - len(stop) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, i + len(stop))
        return best

    def feed(self, text: str, armed: bool = True) -> str:
        """The text that is now safe to send. Only the held-back tail and `text` are searched: the buffer never
        keeps more than the longest stop string less one character. Not `armed` (before min_tokens, as vLLM): no
        stop string ends the text yet, but the tail is kept, since a later match may start in it."""
        if not self.stops:
            return text
        if self.stopped:
            return ""
        buffer = self._buffer + text
        hit = self._first_match(buffer, len(self._buffer)) if armed else None
        if hit is not None:
            self._buffer, self.stopped = "", True
            return buffer[self._sent : hit[1] if self.include else hit[0]]
        keep = min(self._hold, len(buffer))
        end = len(buffer) if self.include else len(buffer) - keep
        out = buffer[self._sent : end]
        self._buffer, self._sent = buffer[len(buffer) - keep :], max(0, end - (len(buffer) - keep))
        return out

    def flush(self) -> str:
        out = "" if self.stopped else self._buffer[self._sent :]
        self._buffer, self._sent = "", 0
        return out


class OutputProcessor:
    """One choice's token chunks -> text deltas: incremental text, stop strings, the finish reason. As vLLM's:
    stop strings end the text only after `min_tokens` tokens; the text of the stop token that ended a choice (EOS,
    a stop_token_ids token) is left out, and the stop string cut off, unless include_stop_str_in_output."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, params: SamplingParams):
        """`params`: the choice's (its text's rules: stop, min_tokens, include_stop_str_in_output,
        skip_special_tokens)."""
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.include_stop = params.include_stop_str_in_output
        self.stop = StopMatcher(list(params.stop), self.include_stop)
        self.min_tokens, self.num_tokens = params.min_tokens, 0

    def feed(self, chunk: TokenChunk) -> TokenChunk:
        """The chunk as the client sees it: its text, its tokens up to a stop string's, "stop" when one hit."""
        ids, logprobs = chunk.token_ids, chunk.logprobs
        # The engine's "stop" is a stop token, the chunk's last one: its text is not the answer's (vLLM's rule).
        n_text = len(ids) - 1 if chunk.finish_reason == "stop" and ids and not self.include_stop else len(ids)
        if self.stop.stops and len(ids) > 1:
            # A token at a time: a stop string ends the choice at the token that completed it, so the tokens the
            # engine made after it in the same chunk (token_ids, logprobs, usage, grounding boxes) are not the
            # answer's. As vLLM: the completion's tokens run up to and including that token.
            text = ""
            for i, token in enumerate(ids):
                armed = self.num_tokens + i + 1 > self.min_tokens
                text += self.stop.feed(self.detok.add([token] if i < n_text else []), armed)
                if self.stop.stopped:
                    ids, logprobs = ids[: i + 1], logprobs[: i + 1] if logprobs is not None else None
                    break
        else:
            text = self.stop.feed(self.detok.add(ids[:n_text]), self.num_tokens + len(ids) > self.min_tokens)
        self.num_tokens += len(ids)
        if chunk.finish_reason is not None and not self.stop.stopped:
            text += self.stop.feed(self.detok.flush(), self.num_tokens > self.min_tokens)
            text += self.stop.flush()
        finish = "stop" if self.stop.stopped else chunk.finish_reason
        return TokenChunk(ids, finish, logprobs, chunk.num_cached_tokens, chunk.prompt_logprobs, text)


__all__ = ["IncrementalDetokenizer", "OutputProcessor", "StopMatcher", "decoder"]
