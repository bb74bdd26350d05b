"""POST /v1/responses' answers: the chat pipeline's one choice as a Response object (`response_body`), or as the
Responses API's typed server-sent events (`response_stream`: response.created, the message's output_text deltas,
each function call's arguments, response.completed or response.incomplete; an `error` event after the first byte).
The request itself is schemas/responses.py's, run as the chat request it translates to."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from deployments.ingress.http import error_body
from deployments.ingress.responses import ChoiceState, Rendering
from deployments.ingress.tool_parser import ParsedCall, ToolCallParser, split_delta
from deployments.ingress.tool_parser import parse as parse_calls
from deployments.ingress.tools import max_calls
from schemas.openai import ChatCompletionRequest
from schemas.responses import ResponsesRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseState:
    """One response as it is made: its fields, its output items (a message, then function calls), its usage."""

    def __init__(self, rreq: ResponsesRequest, req: ChatCompletionRequest, response_id: str, model: str, n_prompt: int):
        self.rreq, self.req, self.id, self.model, self.n_prompt = rreq, req, response_id, model, n_prompt
        self.created_at = int(time.time())
        self.message_id = _id("msg")
        self.output: list[dict[str, Any]] = []

    def message(self, text: str, status: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": [part]}

    @staticmethod
    def function_call(call: ParsedCall, arguments: str, status: str) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": f"fc_{call.id.removeprefix('call_')}",
            "call_id": call.id,
            "name": call.name,
            "arguments": arguments,
            "status": status,
        }

    def body(self, status: str, choice: ChoiceState | None = None) -> dict[str, Any]:
        """The Response object; `choice` (when done): its usage and, when cut by max_output_tokens, why."""
        r = self.rreq
        done = choice is not None
        incomplete = done and choice.finish_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.model,
            "output": self.output if done else [],
            "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": r.temperature,
            "text": {"format": r.text_format},
            "tool_choice": r.tool_choice if r.tool_choice is not None else ("auto" if r.tools else "none"),
            "tools": [_echo_tool(t) for t in r.tools],
            "top_p": r.top_p,
            "truncation": r.truncation,
            "metadata": {},
        } | ({"usage": _usage(self.n_prompt, choice)} if done else {})  # in progress: none yet (not null)


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as the response names it (OpenAI's FunctionTool: parameters and strict always there)."""
    out = {"type": "function", "name": tool.get("name")}
    if tool.get("description"):
        out["description"] = tool["description"]
    return out | {"parameters": tool.get("parameters") or {"type": "object", "properties": {}},
                  "strict": bool(tool.get("strict", False))}  # fmt: skip


def _usage(n_prompt: int, c: ChoiceState) -> dict[str, Any]:
    n_out = len(c.token_ids)
    return {
        "input_tokens": n_prompt,
        # cache_write_tokens: what a prompt-caching API bills as written; this server's prefix cache keeps every block
        "input_tokens_details": {"cached_tokens": c.num_cached_tokens, "cache_write_tokens": 0},
        "output_tokens": n_out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": n_prompt + n_out,
    }


def _status(c: ChoiceState) -> str:
    return "incomplete" if c.finish_reason == "length" else "completed"


async def response_body(state: ResponseState, events, tools: bool) -> tuple[dict[str, Any], ChoiceState]:
    """The Response object of a request not streamed: its message (when it has text or no call) and calls."""
    choice = ChoiceState()
    async for _, delta in events:
        choice.add(delta)
    status = _status(choice)
    text, calls = parse_calls(choice.text, max_calls(state.req)) if tools else (choice.text, [])
    if text or not calls:
        state.output.append(state.message(text or "", status))
    state.output += [state.function_call(call, call.arguments, "completed") for call in calls]
    return state.body(status, choice), choice


async def response_stream(
    state: ResponseState, events, tools: bool, request_id: str, on_done: Callable[[list[ChoiceState]], None]
) -> AsyncIterator[str]:
    """The Responses API's events: created and in_progress; the message item (opened at its first text) with its
    content part and output_text deltas; each function call's item and arguments; the closing events of each;
    completed (or incomplete). With tools, text that may start a call is held back until it is known."""
    choice, seq = ChoiceState(), iter(range(1 << 62))
    parser = ToolCallParser(max_calls(state.req)) if tools else None
    opened, text_so_far = False, ""

    def event(kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": next(seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def open_message() -> list[str]:
        item = {**state.message("", "in_progress"), "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        at = {"item_id": state.message_id, "output_index": 0, "content_index": 0}
        return [
            event("response.output_item.added", output_index=0, item=item),
            event("response.content_part.added", **at, part=part),
        ]

    def close_message(status: str) -> list[str]:
        item = state.message(text_so_far, status)
        part = item["content"][0]
        state.output.insert(0, item)
        at = {"item_id": state.message_id, "output_index": 0, "content_index": 0}
        return [
            event("response.output_text.done", **at, text=text_so_far, logprobs=[]),
            event("response.content_part.done", **at, part=part),
            event("response.output_item.done", output_index=0, item=item),
        ]

    try:
        yield event("response.created", response=state.body("in_progress"))
        yield event("response.in_progress", response=state.body("in_progress"))
        calls: list[ParsedCall] = []
        async for _, delta in events:
            choice.add(delta)
            text, new = split_delta(parser, delta.text, delta.finish_reason is not None)
            if text:
                if not opened:
                    opened = True
                    for line in open_message():
                        yield line
                text_so_far += text
                yield event(
                    "response.output_text.delta", item_id=state.message_id, output_index=0, content_index=0,
                    delta=text, logprobs=[],
                )  # fmt: skip
            calls += new
        status = _status(choice)
        if opened or not calls:  # a message, even an empty one, unless the answer is only calls
            for line in ([] if opened else open_message()) + close_message(status):
                yield line
        for call in calls:
            index = len(state.output)
            item = state.function_call(call, "", "in_progress")
            yield event("response.output_item.added", output_index=index, item=item)
            yield event(
                "response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                delta=call.arguments,
            )  # fmt: skip
            yield event(
                "response.function_call_arguments.done", item_id=item["id"], output_index=index,
                name=call.name, arguments=call.arguments,
            )  # fmt: skip
            done = state.function_call(call, call.arguments, "completed")
            state.output.append(done)
            yield event("response.output_item.done", output_index=index, item=done)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield event(kind, response=state.body(status, choice))
    except Exception as e:  # after the 200: the error goes out as an event, which the OpenAI clients raise
        _, _, body = error_body(e, request_id)
        detail = body.error
        yield event("error", code=detail.code, message=detail.message, param=detail.param)
    finally:
        on_done([choice])


RESPONSES = Rendering(ResponseState, response_body, response_stream)

__all__ = ["RESPONSES", "ResponseState", "response_body", "response_stream"]
