"""Structured outputs in the engine: grammars (xgrammar EBNF text, made by the ingress from `response_format` or a
tool choice) compiled once per grammar against this checkpoint's vocabulary, one matcher per constrained sequence,
and each step's token bitmask of the rows that sample under a grammar.

xgrammar is vLLM's and SGLang's default engine; it installs beside the CPU torch without changing it, and filled a
JSON-schema mask faster than llguidance here (BENCHMARKS.md#structured-outputs)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import xgrammar as xgr

from schemas import InvalidRequest


class Grammars:
    """Compiles grammars for one vocabulary, with an LRU of the compiled ones (a schema is compiled once, then each
    request only makes a matcher). Thread-safe: the replica compiles on a worker thread, off its event loop and off
    the engine's loop. The tokenizer is loaded on the first grammar: a replica that never sees one never pays."""

    def __init__(
        self,
        load_tokenizer: Callable[[], Any] | None,  # None: no tokenizer here, every grammar is refused
        vocab_size: int,
        stop_token_ids: frozenset[int],
        max_cached: int = 256,
    ):
        self._load_tokenizer, self.vocab_size, self.stop_token_ids = load_tokenizer, vocab_size, stop_token_ids
        self.max_cached = max_cached
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # how many grammars were compiled (not found in the cache)

    def _tokenizer_info(self) -> xgr.TokenizerInfo:
        tokenizer = self._load_tokenizer()
        # The logits have the config's vocabulary (Qwen pads the matrix beyond the tokenizer): the extra ids never
        # match. Special tokens (placeholders, grounding marks) get no text, so a grammar never spells a string out
        # of them; xgrammar would otherwise read `<|box_end|>` as eleven characters of a JSON string.
        detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
        special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        tokens = tokenizer.convert_ids_to_tokens(range(len(tokenizer)))
        vocab = ["" if i in special else t for i, t in enumerate(tokens)]
        return xgr.TokenizerInfo(
            vocab,
            detected.vocab_type,
            vocab_size=self.vocab_size,
            stop_token_ids=sorted(self.stop_token_ids),
            add_prefix_space=detected.add_prefix_space,
        )

    def compile(self, grammar: str) -> xgr.CompiledGrammar:
        """The compiled grammar (an EBNF text from the ingress); a grammar xgrammar refuses is an InvalidRequest."""
        if self._load_tokenizer is None:
            raise InvalidRequest("structured outputs are not available on this replica", param="response_format")
        with self._lock:
            if (hit := self._cache.get(grammar)) is not None:
                self._cache.move_to_end(grammar)
                return hit
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(self._tokenizer_info(), max_threads=1, cache_enabled=False)
            try:
                compiled = self._compiler.compile_grammar(grammar)
            except RuntimeError as e:  # the ingress checked it already; a second line of defence
                raise InvalidRequest(f"the grammar cannot be compiled: {e}", param="response_format") from e
            if allows_no_token(new_matcher(compiled), self.vocab_size):  # `root ::= root`: its language is empty
                raise InvalidRequest(
                    "the grammar matches no text: no token can start it, and it cannot end empty",
                    param="response_format",
                )
            self.num_compiled += 1
            self._cache[grammar] = compiled
            if len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return compiled

    def refusal(self, matcher: xgr.GrammarMatcher, token: int, generated: int) -> Exception:
        """Why a sequence's sampled `token` is off its grammar, after `generated` tokens it took: the grammar leads
        nowhere from there (the request's own: a 400), or the mask was not applied (ours)."""
        if allows_no_token(matcher, self.vocab_size):
            why = f"the grammar allows no token after {generated} generated: no way on from there matches any text"
            return InvalidRequest(why, param="response_format")
        return RuntimeError(f"token {token} was sampled outside the grammar after {generated} generated")


def new_matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
    return xgr.GrammarMatcher(compiled)


def allows_no_token(matcher: xgr.GrammarMatcher, vocab_size: int) -> bool:
    """The matcher's grammar allows no next token, not even a stop token: a dead end (`x ::= x` after a prefix)."""
    if matcher.is_terminated():
        return False
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return not _unpack(bitmask, vocab_size).any()


class OffGrammar(Exception):
    """A sampled token its sequence's grammar does not accept (Scheduler.postprocess): the engine fails that
    sequence alone (Grammars.refusal says why), never the step's others."""

    def __init__(self, matcher: xgr.GrammarMatcher, token: int):
        super().__init__(token)
        self.matcher, self.token = matcher, token


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's (R, W) int32 words -> (R, V) bool: bit j of word w allows token 32 * w + j."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    return ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab_size]


Mask = tuple[torch.Tensor, list[int]]  # a step's bitmask (B, W) int32, and the rows that have a grammar


def fill_bitmask(matchers: Sequence[xgr.GrammarMatcher | None], vocab_size: int) -> Mask | None:
    """The allowed-token bitmask (B, ceil(V / 32)) int32 of a batch's sampling rows, in row order, and the rows that
    have a grammar; None when none has. Filled on the host before the step's forward, so it overlaps the device."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)  # all ones: free rows are left as they are
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    return bitmask, rows


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits (B, V): -inf at the tokens the rows' grammars forbid, in place; other rows untouched (their greedy
    tokens stay exactly the unconstrained ones). Bit j of word w allows token 32 * w + j, xgrammar's layout."""
    allowed = _unpack(bitmask[rows].to(logits.device, non_blocking=True), logits.shape[1])  # (R, V)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


__all__ = ["Grammars", "Mask", "OffGrammar", "allows_no_token", "apply_bitmask", "fill_bitmask", "new_matcher"]
