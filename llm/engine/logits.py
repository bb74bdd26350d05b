"""The logits processors of a batch, each vectorised over the rows that use it: `logit_bias`, `min_tokens`, the
penalties (repetition over the prompt and the output; OpenAI's frequency and presence over the output), and `min_p`.

The order is vLLM's sampler's (vllm/v1/sample/sampler.py): logit_bias and min_tokens, then the penalties, all before
the temperature; min_p after it, before top-k and top-p. Each row keeps its token history in a `RowState`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from schemas import SamplingParams


@dataclass(slots=True)
class RowState:
    """What one sequence's rows need besides its parameters, on the logits' device, made at its first sampling."""

    min_tokens_ids: torch.Tensor  # (S,) long: the stop tokens that min_tokens masks (none when it is 0)
    bias_ids: torch.Tensor  # (K,) long: logit_bias's tokens
    bias_values: torch.Tensor  # (K,) float32
    counts: torch.Tensor | None  # (V,) float32: generated-token counts (frequency, presence); None: unused
    seen: torch.Tensor | None  # (V,) bool: prompt and generated tokens (repetition); None: unused
    num_generated: int = 0

    @classmethod
    def start(
        cls,
        params: SamplingParams,
        prompt_ids: list[int],
        stop_token_ids: frozenset[int],
        vocab_size: int,
        device: torch.device,
    ) -> RowState:
        """`stop_token_ids`: the sequence's (EOS unless it ignores EOS, and the request's own)."""
        stops = sorted(t for t in stop_token_ids if 0 <= t < vocab_size) if params.min_tokens else []  # others: never
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            seen[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
        has_openai = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        return cls(
            torch.tensor(stops, dtype=torch.long, device=device),
            torch.tensor(list(params.logit_bias), dtype=torch.long, device=device),
            torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device),
            torch.zeros(vocab_size, device=device) if has_openai else None,
            seen,
        )

    def add(self, token: int) -> None:
        """A token this sequence sampled."""
        self.num_generated += 1
        if self.counts is not None:
            self.counts[token] += 1
        if self.seen is not None:
            self.seen[token] = True


def _scatter(logits: torch.Tensor, rows: list[int], ids: list[torch.Tensor], values, accumulate: bool) -> None:
    """logits[row, id] (+)= value for every row's ids, in one index_put_ for the batch."""
    row_index = torch.cat([torch.full_like(t, r) for r, t in zip(rows, ids, strict=True)])  # (N,)
    col_index = torch.cat(ids)  # (N,)
    if not isinstance(values, torch.Tensor):
        values = torch.cat(values)
    logits.index_put_((row_index, col_index), values, accumulate=accumulate)


def apply_before_temperature(
    logits: torch.Tensor, params: list[SamplingParams], states: list[RowState], free_rows: list[bool]
) -> None:
    """logits (B, V) float32, in place: logit_bias, min_tokens, then the penalties, each on the rows that ask.
    `free_rows`: rows without a grammar; min_tokens applies there alone (a grammar decides where its output ends,
    and masking the EOS it may need would leave such a row nothing to sample)."""
    bias = [i for i, p in enumerate(params) if p.logit_bias]
    if bias:
        _scatter(logits, bias, [states[i].bias_ids for i in bias], [states[i].bias_values for i in bias], True)
    short = [
        i
        for i, (p, s) in enumerate(zip(params, states, strict=True))
        if free_rows[i] and s.num_generated < p.min_tokens and len(s.min_tokens_ids)
    ]
    if short:  # the stop tokens cannot be sampled before min_tokens (vLLM's MinTokensLogitsProcessor)
        ids = [states[i].min_tokens_ids for i in short]
        _scatter(logits, short, ids, torch.tensor(float("-inf"), device=logits.device), False)
    apply_penalties(logits, params, states)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], states: list[RowState]) -> None:
    """Repetition (transformers' and vLLM's: a seen token's positive logit divided by the penalty, a negative one
    multiplied), then OpenAI's frequency and presence over the generated tokens, as vLLM's apply_penalties orders
    them. In place, on the rows that ask."""
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        seen = torch.stack([states[i].seen for i in rep])  # (R, V)
        penalty = torch.tensor([params[i].repetition_penalty for i in rep], device=logits.device)[:, None]  # (R, 1)
        # The API takes any penalty > 0: in float32 1e-300 is 0.0 and a logit divided by it inf, then NaN after the
        # softmax (token 0 was sampled). Past 1e-30 and 1e30 a seen token wins or loses outright either way.
        penalty.clamp_(1e-30, 1e30)
        x = logits[rep]  # (R, V)
        logits[rep] = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    openai = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if openai:
        counts = torch.stack([states[i].counts for i in openai])  # (R, V)
        freq = torch.tensor([params[i].frequency_penalty for i in openai], device=logits.device)[:, None]  # (R, 1)
        pres = torch.tensor([params[i].presence_penalty for i in openai], device=logits.device)[:, None]  # (R, 1)
        logits[openai] -= freq * counts + pres * (counts > 0)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """x (R, V) temperature-scaled logits, min_p (R,) -> x with every token whose probability is below min_p times
    its row's top probability at -inf (the top token always stays; a row with min_p 0 is unchanged)."""
    probs = torch.softmax(x, dim=-1)  # (R, V)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]  # (R, 1)
    return x.masked_fill(probs < threshold, float("-inf"))


__all__ = ["RowState", "apply_before_temperature", "apply_min_p", "apply_penalties"]
