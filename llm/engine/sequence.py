"""One request inside the engine: the checks that turn a `GenerateRequest` into a `Sequence`, and the sequence's state
(its tokens, where its KV lives, which prompt rows are image embeddings, when it stops). State only: the model
runner reads it to build a step's inputs, the scheduler advances it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from xgrammar import CompiledGrammar, GrammarMatcher

from llm.engine.block_pool import block_hash, chain_root
from llm.engine.grammar import new_matcher
from llm.engine.sampling import RowState, make_generator
from llm.model.model import linear_positions, mrope_positions, video_time_interval
from schemas import GenerateRequest, InvalidRequest, MediaItem, SamplingParams, TokenLogprob


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]  # the prompt, then every generated token
    prompt_len: int
    prompt_positions: torch.Tensor  # (3, P) CPU: M-RoPE positions of the prompt
    rope_delta: int  # a generated token at index i sits at position i + rope_delta
    is_multimodal: torch.Tensor  # (P,) bool CPU: image and video placeholder positions of the prompt
    # Per placeholder run, in prompt order (an image's one run, or a Qwen3-VL video's run per tubelet):
    image_embeds: list[torch.Tensor | None]  # its rows (its placeholders, D); None: not arrived
    image_spans: list[tuple[int, int, str]]  # [start, end) in the prompt and its content key
    item_runs: list[range]  # per item (image or video) of the request: the indices of its runs
    params: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()  # the request's, and EOS unless it ignores EOS
    generator: torch.Generator | None = None
    matcher: GrammarMatcher | None = None  # structured outputs: where the output stands in its grammar
    cancelled: threading.Event = field(default_factory=threading.Event)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks, in order
    chain_root: bytes = b""  # the first block's parent: the tenant's cache scope (block_pool.chain_root)
    num_computed: int = 0  # tokens whose KV is in the cache
    num_cached: int | None = None  # prompt tokens found in the prefix cache when first admitted
    logits_state: RowState | None = None  # its token history for the logits processors, from its first sampling
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1, 2, ... (when asked)
    arrived_at: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # first step with this sequence in it
    last_token_at: float | None = None
    num_missing: int = field(init=False)  # images whose embeddings have not arrived

    def __post_init__(self) -> None:
        assert self.prompt_positions.shape == (3, self.prompt_len), self.prompt_positions.shape
        assert len(self.image_embeds) == len(self.image_spans), (len(self.image_embeds), len(self.image_spans))
        self.num_missing = sum(e is None for e in self.image_embeds)  # runs

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def num_schedulable(self, a: int) -> int:
        """Tokens from `a` on that can run: up to the first image whose embeddings have not arrived (prefill
        overlapped with encoding), else all of them."""
        if not self.num_missing:
            return len(self.token_ids) - a
        missing = (max(s, a) for (s, e, _), x in zip(self.image_spans, self.image_embeds) if x is None and e > a)
        return min(missing, default=len(self.token_ids)) - a

    def set_image(self, index: int, embeds: torch.Tensor) -> None:
        """Item `index`'s embeddings have arrived (in any order), rows in prompt order over its runs; raises
        ValueError if they do not fit them."""
        runs = self.item_runs[index]
        n = sum(self.image_spans[r][1] - self.image_spans[r][0] for r in runs)
        if embeds.shape[0] != n:
            raise ValueError(f"image {index}: {embeds.shape[0]} embedding rows for {n} placeholder tokens")
        row = 0
        for r in runs:
            s, e, _ = self.image_spans[r]
            assert self.image_embeds[r] is None, f"image {index} arrived twice"
            self.image_embeds[r], row = embeds[row : row + e - s], row + e - s
            self.num_missing -= 1

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for the prompt's logprobs and has not all of them yet: its prefill must compute every prompt
        row (no prefix-cache hits: a cached block's logits were never kept)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.prompt_len - 1

    def positions(self, a: int, b: int) -> torch.Tensor:
        """(3, b - a) positions of tokens [a, b): the prompt's own, then cache index + rope delta."""
        p = self.prompt_len
        parts = []
        if a < p:
            parts.append(self.prompt_positions[:, a : min(b, p)])
        if b > p:
            parts.append((torch.arange(max(a, p), b) + self.rope_delta).expand(3, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def image_rows(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For tokens [a, b): their placeholder mask (b - a,) and the image embedding rows that fill it, in order
        (a chunk may cut an image: its rows follow the cut); None when no image token is among them."""
        pa, pb = min(a, self.prompt_len), min(b, self.prompt_len)
        rows = []
        for (s, e, _), x in zip(self.image_spans, self.image_embeds):
            if s < pb and e > pa:
                assert x is not None, "a chunk was scheduled over an image that has not arrived"
                rows.append(x[max(pa, s) - s : min(pb, e) - s])  # (rows of this image in the chunk, D)
        if not rows:
            return None
        mask = torch.zeros(b - a, dtype=torch.bool)
        mask[: pb - pa] = self.is_multimodal[pa:pb]
        return mask, rows[0] if len(rows) == 1 else torch.cat(rows)  # (rows in the chunk, D)

    def _image_keys(self, a: int, b: int) -> list[str]:
        return [f"{key}@{max(a, s) - s}" for s, e, key in self.image_spans if s < b and e > a]

    def prefix_hashes(self, block_size: int, n_tokens: int) -> list[bytes]:
        """Hashes of the full blocks among the first `n_tokens` tokens, chained from the start."""
        hashes = list(self.block_hashes[: n_tokens // block_size])
        parent = hashes[-1] if hashes else self.chain_root
        for i in range(len(hashes), n_tokens // block_size):
            a, b = i * block_size, (i + 1) * block_size
            parent = block_hash(parent, self.token_ids[a:b], self._image_keys(a, b))
            hashes.append(parent)
        return hashes


def _image_counts(items: list[MediaItem], embeds: list[torch.Tensor | None], merge_size: int, mrope: bool) -> list[int]:
    """Tokens per image, as the ingress counted them (with M-RoPE, as its grid gives them: positions follow the grid).
    An embedding that has arrived must have as many rows: it comes from an encoder, another process (`ValueError`)."""
    counts = []
    for i, (item, x) in enumerate(zip(items, embeds, strict=True)):
        n, (t, h, w) = item.num_tokens, item.grid_thw
        assert not mrope or n == t * h * w // merge_size**2, f"image {i}: {n} tokens for a grid of {t * h * w} patches"
        if x is not None and x.shape[0] != n:
            raise ValueError(f"image {i}: {x.shape[0]} embedding rows for {n} placeholder tokens")
        counts.append(n)
    return counts


def make_sequence(
    inp: GenerateRequest,
    embeds: list[torch.Tensor | None],
    seq_id: int,
    *,
    max_model_len: int,
    image_token_id: int,
    merge_size: int,
    lm_config: Any,  # the decoder's: M-RoPE when it has an mrope_section; its vocabulary
    device: torch.device,
    eos_token_ids: frozenset[int] = frozenset(),
    grammar: CompiledGrammar | None = None,
    video_token_id: int | None = None,
    tokens_per_second: float | None = None,
) -> Sequence:
    """The sequence's state, after the engine's own checks: its context (its KV cache's bound: `InvalidRequest`) and
    the rows of each embedding that has arrived (`ValueError`).
    What the ingress checked (deployments/ingress/prepare.py and prompt.py: logit_bias within the vocabulary, a prompt
    of at least one token, placeholders only where an image or video is, each one's token count from its size) is
    asserted here, not checked a second time. `embeds`: one per item, its (num_tokens, D) embedding, or None until it
    arrives (`Sequence.set_image`). Videos' placeholders are `video_token_id`; `tokens_per_second`: Qwen2.5-VL's
    temporal position rule."""
    n_prompt, n_max = len(inp.prompt_token_ids), inp.sampling.max_tokens
    bias, vocab_size, mrope = inp.sampling.logit_bias, lm_config.vocab_size, lm_config.mrope_section is not None
    assert not bias or (0 <= min(bias) and max(bias) < vocab_size), f"logit_bias outside the vocabulary: {bias}"
    assert n_prompt > 0, "an empty prompt"
    if n_prompt + n_max > max_model_len:
        raise InvalidRequest(
            f"{n_prompt} prompt tokens + max_tokens {n_max} exceed the context length of {max_model_len}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    ids = torch.tensor(inp.prompt_token_ids, dtype=torch.long)  # (P,)
    is_mm = ids == image_token_id
    if video_token_id is not None:
        is_mm |= ids == video_token_id
    counts = _image_counts(inp.items, embeds, merge_size, mrope)  # one not arrived yet is laid out all the same
    n_mm = int(is_mm.sum())  # counted on the CPU ids
    assert sum(counts) == n_mm, f"{sum(counts)} image or video tokens for {n_mm} placeholder tokens"
    starts = is_mm.nonzero().flatten().tolist()
    spans, run_embeds, item_runs, grids, intervals, k = [], [], [], [], [], 0
    for i, (item, n, x) in enumerate(zip(inp.items, counts, embeds)):
        # No key: a unique one, so that this prompt's image blocks never match another's.
        key = item.key or f"unshared-{inp.request_id}-{i}"
        t, h, w = item.grid_thw
        # A Qwen3-VL video: a run per tubelet, each placed as an image of one tubelet (its text between them).
        n_runs = t if item.tubelet_runs else 1
        per_run = n // n_runs
        item_runs.append(range(len(spans), len(spans) + n_runs))
        for r in range(n_runs):
            a = starts[k]
            assert starts[k + per_run - 1] == a + per_run - 1, (
                f"the {per_run} placeholder tokens of item {i} are not one run"
            )
            spans.append((a, a + per_run, key if n_runs == 1 else f"{key}#{r}"))
            run_embeds.append(None if x is None else x[r * per_run : (r + 1) * per_run])
            k += per_run
        interval = None if (s := item.second_per_grid_t) is None else video_time_interval(s, tokens_per_second)
        grids += [(1, h, w)] * t if item.tubelet_runs else [item.grid_thw]
        intervals += [None] * t if item.tubelet_runs else [interval]
    # NOTE: after the checks above, which are the LLM side's one check of the images against the prompt
    positions, rope_delta = (
        mrope_positions(
            ids, image_token_id, grids, merge_size, video_token_id=video_token_id, time_intervals=intervals or None
        )
        if mrope
        else linear_positions(ids)
    )  # 1-D RoPE LMs (LLaVA's Llama)
    p = inp.sampling
    stop_ids = p.stop_token_ids if p.ignore_eos else p.stop_token_ids | eos_token_ids
    return Sequence(
        seq_id,
        inp.request_id,
        list(inp.prompt_token_ids),
        n_prompt,
        positions,
        rope_delta,
        is_mm,
        run_embeds,
        spans,
        item_runs,
        p,
        stop_ids,
        make_generator(p, device),
        new_matcher(grammar) if grammar is not None else None,
        chain_root=chain_root(inp.cache_scope),
    )


__all__ = ["Sequence", "make_sequence"]
