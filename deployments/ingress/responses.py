"""OpenAI response bodies from text deltas: the whole completion, or its SSE stream (n choices interleaved)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from deployments.ingress.detokenize import decoder
from deployments.ingress.http import error_body, json_text, sse
from deployments.ingress.tool_parser import ToolCallParser, split_delta
from deployments.ingress.tool_parser import parse as parse_calls
from deployments.ingress.tools import max_calls
from schemas import AppArgs, FinishReason, InvalidRequest, TokenChunk, TokenLogprob
from schemas.openai import (
    Box,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    PromptTokensDetails,
    ResponseMessage,
    Usage,
)

BoxesOf = Callable[[list[int]], list[Box] | None]  # a choice's token ids -> its boxes


def logprob_items(tokenizer: PreTrainedTokenizerBase, ids: list[int], lps: list[TokenLogprob]) -> list[dict]:
    """ChoiceLogprobs.content as plain dicts (TokenLogprobOut's fields, in its order): a token's text as
    `tokenizer.decode([id])` gives it."""
    if tokenizer.clean_up_tokenization_spaces:  # decoder() never cleans up
        decode = tokenizer.decode
    else:
        decode = decoder(tokenizer, skip_special_tokens=False)

    def piece(token_id: int, logprob: float) -> dict:
        text = decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [
        {**piece(t, lp.logprob), "top_logprobs": [piece(i, v) for i, v in lp.top]}
        for t, lp in zip(ids, lps, strict=True)
    ]


def to_logprobs(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], lps: list[TokenLogprob] | None
) -> ChoiceLogprobs | None:
    return None if lps is None else ChoiceLogprobs.model_validate({"content": logprob_items(tokenizer, ids, lps)})


class ContentChunks:
    """The stream's per-token event, a content delta, as SSE text without a pydantic model: the constant head
    is encoded once per request, the rest with json_text. It writes what model_dump_json of the equivalent
    ChatCompletionChunk writes (tests/deployments/test_fast_chunks.py compares them)."""

    __slots__ = ("_head",)

    def __init__(self, head: dict):
        fingerprint = head.get("system_fingerprint")
        self._head = (
            f'data: {{"id":{json_text(head["id"])},"object":"chat.completion.chunk",'
            f'"created":{json_text(head["created"])},"model":{json_text(head["model"])},'
            + ("" if fingerprint is None else f'"system_fingerprint":{json_text(fingerprint)},')
            + '"choices":[{"index":'
        )

    def content(
        self, index: int, text: str, token_ids: list[int] | None = None, logprobs: list[dict] | None = None
    ) -> str:
        """The event of choice `index`'s `text`; `token_ids` and `logprobs` (logprob_items) when not None."""
        if token_ids is None and logprobs is None:  # the common case, without the tail
            return f'{self._head}{index},"delta":{{"content":{json_text(text)}}},"finish_reason":null}}]}}\n\n'
        tail = "" if logprobs is None else f',"logprobs":{{"content":{json_text(logprobs)},"refusal":null}}'
        if token_ids is not None:
            tail += f',"token_ids":{json_text(token_ids)}'
        return f'{self._head}{index},"delta":{{"content":{json_text(text)}}},"finish_reason":null{tail}}}]}}\n\n'


def system_fingerprint(args: AppArgs, model_id: str) -> str:
    """OpenAI's `system_fingerprint`: what of the backend can change the tokens of a seeded request (the checkpoint,
    dtypes, devices, engine and encoder settings); limits, URLs and keys do not."""
    config = args.model_dump_json(exclude={"auth", "image_urls", "limits", "served_model_name"})
    return "fp_" + hashlib.blake2b(f"{model_id}\n{config}".encode(), digest_size=5).hexdigest()


async def interleave(firsts: list[TokenChunk], streams: list[AsyncIterator[TokenChunk]]):
    """(choice index, delta) as each choice produces them, starting with the deltas already received."""
    for i, first in enumerate(firsts):
        yield i, first
    if len(streams) == 1:  # the common case, without a task per delta
        if firsts[0].finish_reason is None:
            async for delta in streams[0]:
                yield 0, delta
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams) if firsts[i].finish_reason is None}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    delta = fut.result()
                except StopAsyncIteration:
                    continue
                yield i, delta
                if delta.finish_reason is None:
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for fut in pending:
            fut.cancel()


def deadline_error(timeout_s: float) -> InvalidRequest:
    return InvalidRequest(
        f"request did not finish within its deadline of {timeout_s:g} s", code="request_timeout", status=408
    )


async def with_deadline(events: AsyncIterator, deadline: float, timeout_s: float) -> AsyncIterator:
    """`events` until the loop time `deadline`; then the generations are closed (cancelling them) and a 408."""
    it = aiter(events)
    while True:
        try:
            async with asyncio.timeout_at(deadline):  # only around the wait, never across a yield
                item = await anext(it)
        except StopAsyncIteration:
            return
        except TimeoutError:
            await it.aclose()
            raise deadline_error(timeout_s) from None
        yield item


@dataclass(slots=True)
class ChoiceState:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None

    def add(self, delta: TokenChunk) -> None:
        self.text += delta.text
        self.prompt_logprobs = self.prompt_logprobs if delta.prompt_logprobs is None else delta.prompt_logprobs
        self.num_cached_tokens = delta.num_cached_tokens or self.num_cached_tokens
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += delta.logprobs  # in place: a new list per delta would copy all the earlier ones
        self.finish_reason = delta.finish_reason or self.finish_reason


@dataclass(frozen=True, slots=True)
class Rendering:
    """How a route whose request is chat's in another wire format (the Responses and Messages APIs) answers: its
    state (`state(wire, req, request_id, model, n_prompt)`), its body of one choice (`body(state, events, tools)`
    -> (body, choice)), its event stream (`stream(state, events, tools, request_id, on_done)`)."""

    state: Callable[..., Any]
    body: Callable[..., Any]
    stream: Callable[..., Any]


def usage(n_prompt: int, choices: list[ChoiceState], n: int = 1) -> Usage:
    """`n_prompt`: the tokens of all the prompts; `choices`: n per prompt, prompt by prompt."""
    n_completion = sum(len(c.token_ids) for c in choices)
    # NOTE: the n choices of a prompt share it, counted once; its cached part is its first choice's.
    cached = PromptTokensDetails(cached_tokens=sum(c.num_cached_tokens for c in choices[::n]))
    return Usage(
        prompt_tokens=n_prompt,
        completion_tokens=n_completion,
        total_tokens=n_prompt + n_completion,
        prompt_tokens_details=cached,
    )


def _no_boxes(token_ids: list[int]) -> None:
    return None


def _answer(
    c: ChoiceState, boxes: list[Box] | None, tools: bool, most: int | None
) -> tuple[ResponseMessage, FinishReason | str]:
    """A choice's message and finish reason; with `tools`, its calls parsed out (finish_reason "tool_calls"), at
    most `most` of them."""
    finish = c.finish_reason or "stop"
    if not tools:
        return ResponseMessage(content=c.text, boxes=boxes), finish
    content, calls = parse_calls(c.text, most)
    message = ResponseMessage(content=content, boxes=boxes, tool_calls=[k.response() for k in calls])
    return message, "tool_calls" if calls else finish


async def completion(
    req: ChatCompletionRequest,
    head: dict,
    prompt: list[int],
    events,
    tokenizer: PreTrainedTokenizerBase,
    boxes_of: BoxesOf = _no_boxes,
    tools: bool = False,
) -> tuple[ChatCompletion, list[ChoiceState]]:
    """`tools`: parse the answers' tool calls (deployments/ingress/tools.py's parses_tools)."""
    choices = [ChoiceState() for _ in range(req.n)]
    async for i, delta in events:
        choices[i].add(delta)
    answers = [_answer(c, boxes_of(c.token_ids), tools, max_calls(req)) for c in choices]
    body = ChatCompletion(
        **head,
        usage=usage(len(prompt), choices),
        prompt_token_ids=prompt if req.return_token_ids else None,
        choices=[
            Choice(
                index=i,
                message=message,
                finish_reason=finish,
                logprobs=to_logprobs(tokenizer, c.token_ids, c.logprobs),
                token_ids=c.token_ids if req.return_token_ids else None,
            )
            for i, (c, (message, finish)) in enumerate(zip(choices, answers, strict=True))
        ],
    )
    return body, choices


async def sse_stream(
    req: ChatCompletionRequest,
    head: dict,
    prompt: list[int],
    events,
    tokenizer: PreTrainedTokenizerBase,
    request_id: str,
    on_done: Callable[[list[ChoiceState]], None],
    boxes_of: BoxesOf = _no_boxes,
    tools: bool = False,
) -> AsyncIterator[str]:
    """role chunk per choice, content and tool-call chunks, a finish chunk per choice, the usage chunk, then [DONE].
    With `tools`, text that may start a call is held back until it is known (ToolCallParser)."""
    choices = [ChoiceState() for _ in range(req.n)]
    parsers = [ToolCallParser(max_calls(req)) if tools else None for _ in range(req.n)]
    ids_out, chunks = req.return_token_ids, ContentChunks(head)
    try:
        for i in range(req.n):
            role = ChunkChoice(index=i, delta=Delta(role="assistant", content=""))
            ids = prompt if ids_out and i == 0 else None
            yield sse(ChatCompletionChunk(**head, choices=[role], prompt_token_ids=ids))
        async for i, delta in events:
            choices[i].add(delta)
            parser = parsers[i]
            text, calls = split_delta(parser, delta.text, delta.finish_reason is not None)
            if text or (delta.token_ids and (ids_out or delta.logprobs is not None)):
                lps = None if delta.logprobs is None else logprob_items(tokenizer, delta.token_ids, delta.logprobs)
                yield chunks.content(i, text, delta.token_ids if ids_out else None, lps)
            first = len(parser.calls) - len(calls) if calls else 0  # the calls are numbered within their choice
            for k, call in enumerate(calls, first):
                for d in call.deltas(k):
                    yield sse(ChatCompletionChunk(**head, choices=[ChunkChoice(index=i, delta=Delta(tool_calls=[d]))]))
            if delta.finish_reason is not None:
                yield sse(
                    ChatCompletionChunk(
                        **head,
                        choices=[
                            ChunkChoice(
                                index=i,
                                delta=Delta(boxes=boxes_of(choices[i].token_ids)),
                                finish_reason="tool_calls" if parser and parser.calls else delta.finish_reason,
                            )
                        ],
                    )
                )
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse(ChatCompletionChunk(**head, choices=[], usage=usage(len(prompt), choices)))
    except Exception as e:  # after the 200: the error goes out as an event, which OpenAI clients raise
        yield sse(error_body(e, request_id)[2])
    finally:
        on_done(choices)
    yield "data: [DONE]\n\n"


__all__ = [
    "ChoiceState",
    "Rendering",
    "ContentChunks",
    "completion",
    "deadline_error",
    "interleave",
    "logprob_items",
    "sse_stream",
    "system_fingerprint",
    "to_logprobs",
    "usage",
    "with_deadline",
]
