"""POST /v1/responses, OpenAI's Responses API, as its wire format: the request, and its translation into the chat
request every route runs as (`ResponsesRequest.chat_form`, then `ChatCompletionRequest`'s own validation), so that
limits, images, grammars, tools, cancellation and metrics are chat's, with no second pipeline.

Video, which OpenAI's API does not take, comes as an `input_video` part (`video_url`: chat's video URL rules).

What is refused, by name: `previous_response_id` and `store: true` (no response is kept here), an input item or a
content part other than those below (files, hosted tools, reasoning), and every field the API has that is not here
(`include`, `reasoning`, `background`, ...: Strict)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from schemas.errors import InvalidRequest
from schemas.requests import NO_EFFECT, ChatForm, Strict, unsupported


class ResponsesRequest(Strict):
    ACCEPTED: ClassVar[frozenset[str]] = NO_EFFECT - {"store"}  # metadata, user, ...: nothing to do with the tokens

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(description="A string (one user message), or input items.")
    instructions: str | None = Field(None, description="A system message before the input.")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None  # not OpenAI's; as chat's (vLLM takes it too)
    stop: str | list[str] | None = None  # not OpenAI's; as chat's
    stream: bool = False
    text: dict[str, Any] | None = Field(None, description="`format`: text, json_object or json_schema.")
    tools: list[dict[str, Any]] = Field(default_factory=list, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    truncation: Literal["auto", "disabled"] = Field(
        "disabled", description="auto: drop the oldest whole turns to fit the context; disabled: a 400."
    )
    previous_response_id: str | None = None
    store: bool | None = None

    @model_validator(mode="after")
    def _nothing_stored(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise unsupported(
                "previous_response_id", "no response is stored here: send the conversation as `input` items"
            )
        if self.store:
            raise unsupported("store", "no response is stored here: leave `store` out or send false")
        return self

    @property
    def text_format(self) -> dict[str, Any]:
        return (self.text or {}).get("format") or {"type": "text"}

    def chat_form(self) -> ChatForm:
        """The same request as chat's JSON body (for `ChatCompletionRequest`'s validation), and which of this
        request's fields each of chat's came from."""
        messages, origins = _messages(self.instructions, self.input)
        origins += [("messages", "input"), ("max_completion_tokens", "max_output_tokens"), ("tool_choice.function",
                    "tool_choice"), ("context_overflow", "truncation"), ("response_format.json_schema", "text.format"),
                    ("response_format", "text.format")]  # fmt: skip
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stop,
            "parallel_tool_calls": self.parallel_tool_calls,
            "context_overflow": "drop_oldest_turns" if self.truncation == "auto" else "error",
        }
        if self.tools:
            body["tools"] = [_tool(i, t) for i, t in enumerate(self.tools)]
            origins += [(f"tools[{i}].function", f"tools[{i}]") for i in range(len(self.tools))]
        if self.tool_choice is not None:
            body["tool_choice"] = _tool_choice(self.tool_choice)
        fmt = self.text_format
        if fmt.get("type") == "json_schema":
            spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            body["response_format"] = {"type": "json_schema", "json_schema": spec}
        elif fmt.get("type") == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt.get("type") != "text":
            raise InvalidRequest(f"text.format type {fmt.get('type')!r} is not supported", param="text.format")
        return ChatForm({k: v for k, v in body.items() if v is not None}, tuple(origins))


def _messages(
    instructions: str | None, items: str | list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """Instructions and input items as chat messages: messages as they are (their parts renamed), each run of
    function calls as one assistant message's tool_calls, each call's output as a tool message; and where each
    message came from (ChatForm.origins)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    origins = [("messages[0]", "instructions"), ("messages[0].content", "instructions")] if instructions else []
    if isinstance(items, str):
        n = len(out)
        return [*out, {"role": "user", "content": items}], [*origins, (f"messages[{n}]", "input"),
                                                            (f"messages[{n}].content", "input")]  # fmt: skip
    for i, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None)
        here = f"messages[{len(out)}]"  # the chat message this item starts (or, a parallel call, joins: below)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(f"input[{i}].role {role!r} is not supported", param=f"input[{i}].role")
            content = item.get("content")
            parts = content if isinstance(content, str) else [_part(i, k, p) for k, p in enumerate(content or [])]
            out.append({"role": role, "content": parts})
            origins.append((here, f"input[{i}]"))
            for k, part in enumerate(parts if isinstance(parts, list) else []):
                for field in ("image_url", "video_url"):  # chat's {url} where this API has the URL itself
                    if field in part:
                        origins.append((f"{here}.content[{k}].{field}.url", f"input[{i}].content[{k}].{field}"))
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments", "{}")}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1].get("content"):
                here = f"messages[{len(out) - 1}]"
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append((here, f"input[{i}]"))
            at = f"{here}.tool_calls[{len(out[-1]['tool_calls']) - 1}]"
            origins += [(at, f"input[{i}]"), (f"{at}.function", f"input[{i}]"), (f"{at}.id", f"input[{i}].call_id")]
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else "".join(p.get("text", "") for p in output or [])
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
            origins += [(here, f"input[{i}]"), (f"{here}.tool_call_id", f"input[{i}].call_id"),
                        (f"{here}.content", f"input[{i}].output")]  # fmt: skip
        else:
            raise InvalidRequest(
                f"input[{i}]: items of type {kind!r} are not supported (message, function_call, function_call_output)",
                param=f"input[{i}].type",
            )
    return out, origins


def _part(i: int, k: int, part: dict[str, Any]) -> dict[str, Any]:
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text")}
    if kind == "input_image":
        if part.get("image_url") is None:  # file_id: no file store here
            raise InvalidRequest(
                f"input[{i}].content[{k}]: an input_image needs an image_url (no file_id: files are not stored here)",
                param=f"input[{i}].content[{k}].image_url",
            )
        return {"type": "image_url", "image_url": {"url": part["image_url"], "detail": part.get("detail", "auto")}}
    if kind == "input_video":  # not OpenAI's (its API takes no video): chat's video_url part, as input_image is
        return {"type": "video_url", "video_url": {"url": part.get("video_url")}}
    raise InvalidRequest(
        f"input[{i}].content[{k}]: parts of type {kind!r} are not supported (input_text, input_image, input_video)",
        param=f"input[{i}].content[{k}].type",
    )


def _tool(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise InvalidRequest(
            f"tools[{i}]: tools of type {tool.get('type')!r} are not supported (function)", param=f"tools[{i}].type"
        )
    keys = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: tool[k] for k in keys if tool.get(k) is not None}}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise InvalidRequest(f"tool_choice of type {choice.get('type')!r} is not supported", param="tool_choice")


__all__ = ["ResponsesRequest"]
