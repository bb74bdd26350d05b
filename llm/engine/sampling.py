"""Next tokens for a whole batch, each row with its own settings: the logits processors (logits.py: logit_bias,
min_tokens, penalties), a grammar's token bitmask, greedy or temperature, min_p, top-k, top-p, a per-request seed
(the same tokens whatever the batch neighbours), and logprobs of the raw distribution."""

from __future__ import annotations

import torch

from llm.engine.grammar import apply_bitmask
from llm.engine.logits import RowState, apply_before_temperature, apply_min_p
from schemas import SamplingParams, TokenLogprob


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


__all__ = ["make_generator", "on_device", "prompt_logprobs", "sample", "sample_tokens"]
