"""Text completion bodies (POST /v1/completions) from text deltas: the whole `text_completion`, or its SSE stream,
and the legacy logprobs format. Choice i is prompt i // n's choice i % n, as vLLM numbers them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from transformers import PreTrainedTokenizerBase

from deployments.ingress.http import error_body, sse
from deployments.ingress.prepare import Prepared
from deployments.ingress.responses import ChoiceState, logprob_items, usage
from schemas import TokenLogprob
from schemas.completions import CompletionChoice, CompletionLogprobs, CompletionRequest, TextCompletion


def legacy_logprobs(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], lps: list[TokenLogprob], offset: int
) -> CompletionLogprobs:
    """The legacy format of these tokens, the first at `offset` in the choice's text. Each token's text is the
    chat format's (logprob_items); its top {text: logprob} holds the k most likely and the sampled token (OpenAI:
    "up to logprobs + 1 elements"); two tokens with one text keep the likelier."""
    items = logprob_items(tokenizer, ids, lps)
    offsets, tops = [], []
    for item in items:
        offsets.append(offset)
        offset += len(item["token"])
        top: dict[str, float] = {}
        for t in [*item["top_logprobs"], item]:
            top.setdefault(t["token"], t["logprob"])
        tops.append(top)
    return CompletionLogprobs(
        tokens=[item["token"] for item in items],
        token_logprobs=[item["logprob"] for item in items],
        text_offset=offsets,
        top_logprobs=tops,
    )


def echo_logprobs(tokenizer: PreTrainedTokenizerBase, ids: list[int], lps: list[TokenLogprob]) -> CompletionLogprobs:
    """The echoed prompt's tokens in the legacy format (offsets from 0, as vLLM's): `lps` are the engine's prompt
    logprobs, one per token after the first; the first has null for both (nothing precedes it)."""
    assert len(lps) == len(ids) - 1, (len(lps), len(ids))
    first = legacy_logprobs(tokenizer, ids[:1], [TokenLogprob(0.0, [])], 0)
    rest = legacy_logprobs(tokenizer, ids[1:], lps, len(first.tokens[0]))
    return first.model_copy(update={"token_logprobs": [None], "top_logprobs": [None]}) + rest


def _echo(req: CompletionRequest, p: Prepared) -> str:
    return p.text if req.echo else ""


def _prompt_logprobs(req, tokenizer, prompts: list[Prepared], choices: list[ChoiceState], i: int):
    """Choice i's echoed prompt logprobs (its prompt's first choice computed them), or None when not asked."""
    if req.num_prompt_logprobs is None:
        return None
    k = i // req.n
    return echo_logprobs(tokenizer, prompts[k].prompt, choices[k * req.n].prompt_logprobs or [])


def _usage(prompts: list[Prepared], choices: list[ChoiceState], n: int):
    return usage(sum(len(p.prompt) for p in prompts), choices, n)


async def text_completion(
    req: CompletionRequest, head: dict, prompts: list[Prepared], events, tokenizer: PreTrainedTokenizerBase
) -> tuple[TextCompletion, list[ChoiceState]]:
    choices = [ChoiceState() for _ in range(len(prompts) * req.n)]
    async for i, delta in events:
        choices[i].add(delta)
    out = []
    for i, c in enumerate(choices):
        p = prompts[i // req.n]
        echo, echoed = _echo(req, p), _prompt_logprobs(req, tokenizer, prompts, choices, i)
        start = len(echo) if echoed is None else sum(len(t) for t in echoed.tokens)  # the output's first offset
        logprobs = None if c.logprobs is None else legacy_logprobs(tokenizer, c.token_ids, c.logprobs, start)
        logprobs = logprobs if echoed is None else echoed + logprobs
        out.append(
            CompletionChoice(
                index=i,
                text=echo + c.text,
                logprobs=logprobs,
                finish_reason=c.finish_reason or "stop",
                token_ids=c.token_ids if req.return_token_ids else None,
                prompt_token_ids=p.prompt if req.return_token_ids else None,
            )
        )
    return TextCompletion(**head, choices=out, usage=_usage(prompts, choices, req.n)), choices


async def text_sse_stream(
    req: CompletionRequest,
    head: dict,
    prompts: list[Prepared],
    events,
    tokenizer: PreTrainedTokenizerBase,
    request_id: str,
    on_done: Callable[[list[ChoiceState]], None],
) -> AsyncIterator[str]:
    """A chunk per delta of each choice (the echoed prompt first), the last with its finish_reason; the usage chunk
    when asked; then [DONE]. With return_token_ids, a choice's first chunk carries its prompt's ids. With echo and
    logprobs, a choice's echo goes out with its first delta, which brings the prompt's logprobs."""
    choices = [ChoiceState() for _ in range(len(prompts) * req.n)]
    offsets = [len(_echo(req, prompts[i // req.n])) for i in range(len(choices))]
    # With logprobs, each echo waits for its choice's first delta (after its prompt's first choice's, which has them).
    unechoed = set(range(len(choices))) if req.echo and req.num_prompt_logprobs is not None else set()
    ids_out, first = req.return_token_ids, set(range(len(choices)))

    def chunk(i: int, text: str, **fields) -> str:
        prompt_ids = prompts[i // req.n].prompt if ids_out and i in first else None
        first.discard(i)
        choice = CompletionChoice(index=i, text=text, prompt_token_ids=prompt_ids, **fields)
        return sse(TextCompletion(**head, choices=[choice]))

    try:
        if req.echo and not unechoed:
            for i in range(len(choices)):
                yield chunk(i, prompts[i // req.n].text)
        async for i, delta in events:
            choices[i].add(delta)
            if i in unechoed:
                unechoed.discard(i)
                lps = _prompt_logprobs(req, tokenizer, prompts, choices, i)
                offsets[i] = sum(len(t) for t in lps.tokens)
                yield chunk(i, prompts[i // req.n].text, logprobs=lps)
            logprobs = None
            if delta.logprobs is not None:
                logprobs = legacy_logprobs(tokenizer, delta.token_ids, delta.logprobs, offsets[i])
                offsets[i] += sum(len(t) for t in logprobs.tokens)
            if delta.text or delta.finish_reason or (delta.token_ids and (ids_out or logprobs is not None)):
                ids = delta.token_ids if ids_out else None
                yield chunk(i, delta.text, logprobs=logprobs, finish_reason=delta.finish_reason, token_ids=ids)
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse(TextCompletion(**head, choices=[], usage=_usage(prompts, choices, req.n)))
    except Exception as e:  # after the 200: the error goes out as an event, which OpenAI clients raise
        yield sse(error_body(e, request_id)[2])
    finally:
        on_done(choices)
    yield "data: [DONE]\n\n"


__all__ = ["legacy_logprobs", "text_completion", "text_sse_stream"]
