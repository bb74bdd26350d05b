"""POST /v1/messages, Anthropic's Messages API, as its wire format: the request, and its translation into the chat
request every route runs as (`MessagesRequest.chat_form`, then `ChatCompletionRequest`'s own validation), as
schemas/responses.py does for OpenAI's Responses API: one pipeline for the three.

Blocks taken: `text`; `image` with a base64 source (a data: URL inside) or a url source (the server's URL rules);
`tool_use` (an assistant's calls) and `tool_result` (their outputs, tool messages). Anything else (documents,
thinking, server tools) is a 400 naming it."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import Field

from schemas.errors import InvalidRequest
from schemas.requests import ChatForm, Strict


class MessagesRequest(Strict):
    ACCEPTED: ClassVar[frozenset[str]] = frozenset({"metadata", "service_tier"})  # nothing to do with the tokens

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    stream: bool = False
    tools: list[dict[str, Any]] = Field(default_factory=list, max_length=128)
    tool_choice: dict[str, Any] | None = None

    def chat_form(self) -> ChatForm:
        """The same request as chat's JSON body (for `ChatCompletionRequest`'s validation), and which of this
        request's fields each of chat's came from."""
        messages, origins = _messages(self.system, self.messages)
        origins += [("max_completion_tokens", "max_tokens"), ("stop", "stop_sequences"), ("tool_choice.function",
                    "tool_choice"), ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use")]  # fmt: skip
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences,
        }
        if self.tools:
            body["tools"] = [_tool(i, t) for i, t in enumerate(self.tools)]
            for i in range(len(self.tools)):
                origins += [(f"tools[{i}].function", f"tools[{i}]"), (f"tools[{i}].function.parameters",
                            f"tools[{i}].input_schema")]  # fmt: skip
        if self.tool_choice is not None:
            body["tool_choice"], parallel = _tool_choice(self.tool_choice)
            body["parallel_tool_calls"] = parallel
        return ChatForm({k: v for k, v in body.items() if v is not None}, tuple(origins))


def _text(blocks: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    for k, block in enumerate(blocks):
        if block.get("type") != "text":
            raise InvalidRequest(f"{where}[{k}]: only text blocks are taken here", param=f"{where}[{k}].type")
    return "".join(block.get("text", "") for block in blocks)


def _messages(
    system: str | list[dict[str, Any]] | None, messages: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """System and messages as chat messages: a message's text and image blocks as its parts, its tool_use blocks as
    its tool_calls, each tool_result block as a tool message before it; and where each came from (ChatForm.origins:
    a part's index in chat's message is not its block's)."""
    out = [{"role": "system", "content": _text(system, "system")}] if system else []
    origins = [("messages[0]", "system"), ("messages[0].content", "system")] if system else []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise InvalidRequest(f"messages[{i}].role {role!r} is not user or assistant", param=f"messages[{i}].role")
        if isinstance(content, str):
            origins.append((f"messages[{len(out)}]", f"messages[{i}]"))
            out.append({"role": role, "content": content})
            continue
        parts, calls, blocks = [], [], []  # blocks: (chat's path in this message, the block's own path)
        for k, block in enumerate(content or []):
            where, kind = f"messages[{i}].content[{k}]", block.get("type")
            if kind == "text":
                blocks.append((f"content[{len(parts)}]", where))
                parts.append({"type": "text", "text": block.get("text", "")})
            elif kind == "image":
                at = f"content[{len(parts)}]"
                blocks += [
                    (at, where),
                    (f"{at}.image_url", f"{where}.source"),
                    (f"{at}.image_url.url", f"{where}.source"),
                ]
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source") or {}, where)}})
            elif kind == "tool_use" and role == "assistant":
                at = f"tool_calls[{len(calls)}]"
                blocks += [(at, where), (f"{at}.function", where), (f"{at}.function.arguments", f"{where}.input")]
                arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"), "arguments": arguments}})  # fmt: skip
            elif kind == "tool_result" and role == "user":
                result = block.get("content") or ""
                here = f"messages[{len(out)}]"
                origins += [(here, where), (f"{here}.tool_call_id", f"{where}.tool_use_id"),
                            (f"{here}.content", f"{where}.content")]  # fmt: skip
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _text(result, f"{where}.content")})  # fmt: skip
            else:
                raise InvalidRequest(
                    f"{where}: {kind!r} blocks are not taken in a {role} message", param=f"{where}.type"
                )
        if parts or calls:
            here = f"messages[{len(out)}]"
            origins += [(here, f"messages[{i}]"), *((f"{here}.{chat}", own) for chat, own in blocks)]
            out.append({"role": role, "content": parts or None, **({"tool_calls": calls} if calls else {})})
    return out, origins


def _image_url(source: dict[str, Any], where: str) -> str:
    if source.get("type") == "base64":
        return f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    if source.get("type") == "url":
        return str(source.get("url"))
    raise InvalidRequest(
        f"{where}.source: an image source of type {source.get('type')!r} is not taken (base64, url)",
        param=f"{where}.source.type",
    )


def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") not in (None, "custom") or "name" not in tool:
        raise InvalidRequest(f"tools[{i}]: only client tools (name, input_schema) are taken", param=f"tools[{i}]")
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> tuple[str | dict[str, Any], bool]:
    """(chat's tool_choice, parallel_tool_calls) of Anthropic's."""
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise InvalidRequest(f"tool_choice of type {kind!r} is not supported", param="tool_choice.type")


__all__ = ["MessagesRequest"]
