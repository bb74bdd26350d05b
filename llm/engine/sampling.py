"""Next tokens for a whole batch, each row with its own settings: the logits processors, each vectorised over the rows
that use it (`logit_bias`, `min_tokens`, the penalties: repetition over the prompt and the output, OpenAI's frequency
and presence over the output; `min_p`), a grammar's token bitmask, greedy or temperature, top-k, top-p, a per-request
seed (the same tokens whatever the batch neighbours), and logprobs of the raw distribution.

The order is vLLM's sampler's (vllm/v1/sample/sampler.py): logit_bias and min_tokens, then the penalties, all before
the temperature; min_p after it, before top-k and top-p. Each row keeps its token history in a `RowState`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm.engine.grammar import apply_bitmask
from schemas import SamplingParams, TokenLogprob


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


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A seeded generator per request makes it reproducible whatever else the replica is doing."""
    if params.temperature == 0.0:
        return None
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def _filter_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x (B, V) scaled logits -> probabilities with everything outside each row's top-k and top-p zeroed."""
    sorted_x, order = x.sort(dim=-1, descending=True)  # (B, V)
    ranks = torch.arange(x.shape[-1], device=x.device)
    sorted_x = sorted_x.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    sorted_p = torch.softmax(sorted_x, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p; the best token always stays, even at a top_p that is 0.0
    # in float32 (1e-46 passes the API's top_p > 0).
    beyond = (sorted_p.cumsum(-1) - sorted_p >= top_p[:, None]) & (ranks[None, :] > 0)
    sorted_p = sorted_p.masked_fill(beyond, 0.0)
    return torch.zeros_like(sorted_p).scatter_(-1, order, sorted_p)


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without a host sync (pinned, non-blocking on cuda): `torch.tensor(values,
    device="cuda")` waits for the device's queue, which would stall a step launched ahead (engine.py)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    states: list[RowState],
    grammar_mask: tuple[torch.Tensor, list[int]] | None = None,
) -> torch.Tensor:
    """logits (B, V) float32 -> one token id per row, (B,) long on the logits' device, without a host sync where no
    row has a grammar or a penalty (their history is on the host). In place on `logits`. See `sample`."""
    B, V = logits.shape
    device = logits.device
    grammar_rows = set(grammar_mask[1]) if grammar_mask is not None else set()
    apply_before_temperature(logits, params, states, [i not in grammar_rows for i in range(B)])
    if grammar_mask is not None:  # after the penalties; the logprobs above stay the raw distribution's
        apply_bitmask(logits, *grammar_mask)
    rand = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if not rand:
        return logits.argmax(-1)
    tokens = torch.empty(B, dtype=torch.long, device=device)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    if greedy:
        index = on_device(greedy, torch.long, device)
        tokens[index] = logits[index].argmax(-1)
    temps = on_device([params[i].temperature for i in rand], torch.float32, device)
    index = on_device(rand, torch.long, device)
    x = logits[index] / temps[:, None]  # (R, V)
    if any(params[i].min_p > 0.0 for i in rand):  # after the temperature, before top-k/top-p (vLLM's order)
        x = apply_min_p(x, on_device([params[i].min_p for i in rand], torch.float32, device))
    if any(params[i].top_k > 0 or params[i].top_p < 1.0 for i in rand):
        top_k = on_device([params[i].top_k or V for i in rand], torch.long, device)
        top_p = on_device([params[i].top_p for i in rand], torch.float32, device)
        probs = _filter_top_k_top_p(x, top_k, top_p)
    else:
        probs = torch.softmax(x, dim=-1)
    # Gumbel-max in its exponential form, argmax(p / E) with E ~ Exp(1), as nano-vllm samples; each row
    # draws from its own generator so a request's tokens do not depend on its neighbours.
    noise = torch.stack([torch.empty(V, device=device).exponential_(1.0, generator=generators[i]) for i in rand])
    tokens[index] = (probs / noise).argmax(-1)
    return tokens


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    states: list[RowState],
    grammar_mask: tuple[torch.Tensor, list[int]] | None = None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits (B, V) float32 -> one token id per row (one host sync for the batch), and logprobs where asked.
    `states`: each row's token history (logits.RowState; the caller adds the sampled tokens to it).
    `grammar_mask`: (bitmask, rows) from grammar.fill_bitmask; those rows sample only the tokens it allows."""
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs for p in params) else None
    token_ids = sample_tokens(logits, params, generators, states, grammar_mask).tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    if raw_logprobs is not None:
        for i, p in enumerate(params):
            if p.logprobs:
                top = raw_logprobs[i].topk(p.top_logprobs) if p.top_logprobs else None
                pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else []
                logprobs[i] = TokenLogprob(float(raw_logprobs[i, token_ids[i]]), pairs)
    return token_ids, logprobs


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """logits (R, V) float32 of R prompt rows -> the logprob of the token that follows each row (`targets`), with
    the k most likely, of the raw distribution: vLLM's prompt_logprobs."""
    lp = torch.log_softmax(logits, dim=-1)  # (R, V)
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None]).squeeze(1).tolist()  # (R,)
    if not k:
        return [TokenLogprob(c, []) for c in chosen]
    top = lp.topk(k, dim=-1)  # (R, k)
    pairs = [list(zip(i, v, strict=True)) for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)]
    return [TokenLogprob(c, p) for c, p in zip(chosen, pairs, strict=True)]


__all__ = [
    "RowState",
    "apply_before_temperature",
    "apply_min_p",
    "apply_penalties",
    "make_generator",
    "on_device",
    "prompt_logprobs",
    "sample",
    "sample_tokens",
]
