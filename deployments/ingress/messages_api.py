"""POST /v1/messages' answers, Anthropic's Messages API: the chat pipeline's one choice as a `message`
(`message_body`: a text block, then a tool_use block per call), or as Anthropic's events (`message_stream`:
message_start, each content block's start, deltas and stop, message_delta with the stop reason and usage,
message_stop; an `error` event after the first byte); and every error in Anthropic's shape (`anthropic_error`).
The request itself is schemas/anthropic.py's, run as the chat request it translates to."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import JSONResponse

from deployments.ingress.http import error_body
from deployments.ingress.responses import ChoiceState, Rendering
from deployments.ingress.tool_parser import ParsedCall, ToolCallParser, split_delta
from deployments.ingress.tool_parser import parse as parse_calls
from deployments.ingress.tools import max_calls
from schemas.openai import ChatCompletionRequest

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
}  # fmt: skip


def _error(e: BaseException, request_id: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    status, headers, body = error_body(e, request_id)
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, headers, {"type": "error", "error": {"type": kind, "message": body.error.message}}


def anthropic_error(e: BaseException, request_id: str) -> JSONResponse:
    """The error answer of /v1/messages: chat's status, in Anthropic's body."""
    status, headers, body = _error(e, request_id)
    return JSONResponse(body, status_code=status, headers=headers)


class MessageState:
    """One message as it is made: its id (the request's), model, prompt length."""

    def __init__(self, wire: Any, req: ChatCompletionRequest, message_id: str, model: str, n_prompt: int):
        """`wire`: the Messages request (its fields are the chat request's now)."""
        self.req, self.id, self.model, self.n_prompt = req, message_id, model, n_prompt

    def head(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def usage(self, c: ChoiceState) -> dict[str, int]:
        return {
            "input_tokens": self.n_prompt,
            "output_tokens": len(c.token_ids),
            "cache_read_input_tokens": c.num_cached_tokens,
            "cache_creation_input_tokens": 0,
        }


def _tool_use(call: ParsedCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)}


def _stop_reason(c: ChoiceState, calls: list[ParsedCall]) -> str:
    if calls:
        return "tool_use"
    return "max_tokens" if c.finish_reason == "length" else "end_turn"


async def message_body(state: MessageState, events, tools: bool) -> tuple[dict[str, Any], ChoiceState]:
    choice = ChoiceState()
    async for _, delta in events:
        choice.add(delta)
    text, calls = parse_calls(choice.text, max_calls(state.req)) if tools else (choice.text, [])
    content = ([{"type": "text", "text": text}] if text or not calls else []) + [_tool_use(c) for c in calls]
    body = {
        **state.head(),
        "content": content,
        "stop_reason": _stop_reason(choice, calls),
        "stop_sequence": None,
        "usage": state.usage(choice),
    }
    return body, choice


async def message_stream(
    state: MessageState, events, tools: bool, request_id: str, on_done: Callable[[list[ChoiceState]], None]
) -> AsyncIterator[str]:
    """Anthropic's events. With tools, text that may start a call is held back until it is known."""
    choice = ChoiceState()
    parser = ToolCallParser(max_calls(state.req)) if tools else None
    index, text_open = 0, False

    def event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"

    try:
        start = {**state.head(), "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": state.n_prompt, "output_tokens": 0}}  # fmt: skip
        yield event("message_start", message=start)
        calls: list[ParsedCall] = []
        async for _, delta in events:
            choice.add(delta)
            text, new = split_delta(parser, delta.text, delta.finish_reason is not None)
            if text:
                if not text_open:
                    text_open = True
                    yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": text})
            calls += new
        if text_open or not calls:  # a text block, even an empty one, unless the answer is only calls
            if not text_open:
                yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
            yield event("content_block_stop", index=index)
            index += 1
        for call in calls:
            block = {**_tool_use(call), "input": {}}
            yield event("content_block_start", index=index, content_block=block)
            yield event("content_block_delta", index=index, delta={"type": "input_json_delta",
                                                                  "partial_json": call.arguments})  # fmt: skip
            yield event("content_block_stop", index=index)
            index += 1
        stop = {"stop_reason": _stop_reason(choice, calls), "stop_sequence": None}
        yield event("message_delta", delta=stop, usage={"output_tokens": len(choice.token_ids)})
        yield event("message_stop")
    except Exception as e:  # after the 200: Anthropic's error event
        _, _, body = _error(e, request_id)
        yield event("error", error=body["error"])
    finally:
        on_done([choice])


MESSAGES = Rendering(MessageState, message_body, message_stream)

__all__ = ["MESSAGES", "MessageState", "anthropic_error", "message_body", "message_stream"]
