"""Tool calling at the ingress: the request's tools checked against its history, shown to the model (by the chat
template, or in a system preamble where the template cannot show them), the grammar that makes `required` and a
named `tool_choice` a valid call whatever the weights, and which answers are parsed. The call format is the hermes
one of Qwen2.5's template (deployments/ingress/tool_parser.py)."""

from __future__ import annotations

import functools
import json

import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from deployments.ingress import client_json
from deployments.ingress.structured import json_grammar
from deployments.ingress.tool_parser import END, START
from schemas import InvalidRequest
from schemas.openai import ChatCompletionRequest, Message, TextPart


def renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template can show the model its tools: it names `tools` (Qwen2.5's does, Qwen2-VL's and
    llava-hf's do not). One that does not would drop them silently: tools_as_text describes them instead."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates: apply_chat_template picks "tool_use" for tools when present
        template = template.get("tool_use") or template.get("default") or ""
    return "tools" in (template or "")


def tool_choice(req: ChatCompletionRequest) -> str:
    """ "none", "auto", "required" or "named"; as OpenAI: auto with tools, none without."""
    choice = req.tool_choice or ("auto" if req.tools else "none")
    return choice if isinstance(choice, str) else "named"


def parses_tools(req: ChatCompletionRequest) -> bool:
    """Whether the answers are searched for calls: under "none" the tools are shown but never called (vLLM's)."""
    return bool(req.tools) and tool_choice(req) != "none"


def max_calls(req: ChatCompletionRequest) -> int | None:
    """The most tool calls an answer keeps: one without `parallel_tool_calls`, under "auto" too (vLLM keeps the
    first; "required" and named choices are held to it by their grammar as well)."""
    return None if req.parallel_tool_calls else 1


def check_tools(req: ChatCompletionRequest) -> None:
    """The request's tool fields and agent-loop history, before any other work."""
    names = [t.function.name for t in req.tools]
    choice = tool_choice(req)
    if choice in ("required", "named") and not req.tools:
        raise InvalidRequest(f"tool_choice {choice!r} needs tools", param="tool_choice")
    if choice == "named" and req.tool_choice.function.name not in names:
        raise InvalidRequest(
            f"tool_choice names {req.tool_choice.function.name!r}, which is not among the tools {names}",
            param="tool_choice.function.name",
        )
    if choice in ("required", "named") and (req.response_format or req.structured_outputs):
        raise InvalidRequest(f"tool_choice {choice!r} and a response format cannot both hold", param="tool_choice")
    called: set[str] = set()
    for i, m in enumerate(req.messages):
        for j, call in enumerate(m.tool_calls):
            called.add(call.id)
            param = f"messages[{i}].tool_calls[{j}].function.arguments"
            client_json.loads(call.function.arguments, param, param)  # rendered below: JSON, and bounded
        if m.role == "tool" and m.tool_call_id not in called:
            raise InvalidRequest(
                f"messages[{i}]: no earlier assistant message made a call with id {m.tool_call_id!r}",
                param=f"messages[{i}].tool_call_id",
            )


def template_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools as chat templates take them (OpenAI's form), or None."""
    return [t.model_dump(exclude={"function": {"strict"}}, exclude_none=True) for t in req.tools] or None


def tools_as_text(req: ChatCompletionRequest, messages: list[Message]) -> list[Message]:
    """`messages` for a chat template that cannot show tools (renders_tools is false): the tools described in a
    system preamble (merged into a leading system message, else one of its own), an assistant's calls written in
    its text as the hermes blocks the preamble asks for, and tool results as a user turn of `<tool_response>` blocks
    (consecutive ones in one turn), so that the template renders them all as plain turns. The same request to a
    template that shows tools gets them from the template instead.

    NOTE: the idea is text-generation-inference's (router/src/infer/chat_template.rs: a template whose variables
    do not include `tools` gets the tools as JSON with a tool prompt appended to the last message) and llama.cpp's
    generic tool format (a system message that describes the tools and the answer's JSON); vLLM itself passes the
    tools to any template, and one that does not use them drops them. A system preamble keeps the user's turn as
    written; the format is the hermes one our parser and grammars use (ours, not a copy of either)."""
    if not req.tools and not any(m.tool_calls or m.role == "tool" for m in messages):
        return messages
    out: list[Message] = []
    for i, m in enumerate(messages):
        if m.role == "tool":
            block = f"<tool_response>\n{_text(m)}\n</tool_response>"
            if i > 0 and messages[i - 1].role == "tool":  # the results of one turn's calls: one user turn
                out[-1] = out[-1].model_copy(update={"content": f"{out[-1].content}\n{block}"})
            else:
                out.append(Message(role="user", content=block))
        elif m.tool_calls:
            calls = [  # as the grammars write them: JSON with ", " and ": "; arguments checked by check_tools
                json.dumps({"name": c.function.name, "arguments": json.loads(c.function.arguments)}, ensure_ascii=False)
                for c in m.tool_calls
            ]
            calls = [f"{START}\n{call}\n{END}" for call in calls]
            out.append(Message(role="assistant", content="\n".join(filter(None, [_text(m), *calls]))))
        else:
            out.append(m)
    if req.tools:
        lead = out[0] if out and out[0].role in ("system", "developer") else None
        text = _preamble(req) + (f"\n\n{_text(lead)}" if lead is not None and _text(lead) else "")
        out = [Message(role=lead.role if lead is not None else "system", content=text), *out[lead is not None :]]
    return out


def _text(m: Message) -> str:
    """A message's text: its string, or its text parts joined (system, assistant and tool messages hold no media)."""
    if isinstance(m.content, list):
        return "".join(p.text for p in m.content if isinstance(p, TextPart))
    return m.content or ""


def _preamble(req: ChatCompletionRequest) -> str:
    """The tools and how to call them, in the hermes format of the parser and the grammars."""
    tools = "\n".join(json.dumps(t, ensure_ascii=False) for t in template_tools(req))
    one = " Call at most one function per answer." if not req.parallel_tool_calls else ""
    return (
        "# Tools\n\nYou can call functions to answer. Their signatures, one JSON object a line, are within "
        f"<tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, write a JSON object with its name "
        f"and its arguments within {START}{END} tags:\n{START}\n"
        f'{{"name": <function name>, "arguments": <the arguments as a JSON object>}}\n{END}\n'
        f"Each result comes back within <tool_response></tool_response> tags.{one}"
    )


def tool_grammar(req: ChatCompletionRequest) -> str | None:
    """The grammar of the answer under "required" (one call, or several with parallel_tool_calls) or a named
    choice (one call of it); None where the model answers freely."""
    choice = tool_choice(req)
    if choice not in ("required", "named"):
        return None
    tools = [t for t in req.tools if choice == "required" or t.function.name == req.tool_choice.function.name]
    schemas = tuple(json.dumps(t.function.parameters) for t in tools)  # key order kept: properties come in it
    params = tuple(f"tools[{req.tools.index(t)}].function.parameters" for t in tools)
    return _calls_grammar(
        tuple(t.function.name for t in tools), schemas, params, choice == "required" and req.parallel_tool_calls
    )


@functools.lru_cache(maxsize=256)
def _calls_grammar(names: tuple[str, ...], schemas: tuple[str, ...], params: tuple[str, ...], several: bool) -> str:
    calls = [
        xgr.Grammar.concat(
            _literal(f'{START}\n{{"name": {json.dumps(name)}, "arguments": '),
            xgr.Grammar.from_ebnf(json_grammar(schema, param)),
            _literal(f"}}\n{END}"),
        )
        for name, schema, param in zip(names, schemas, params, strict=True)
    ]
    one = str(xgr.Grammar.union(*calls) if len(calls) > 1 else calls[0])
    if not several:
        return one
    # NOTE: Qwen2.5's template writes several calls one per line; the union's root becomes the one-call rule.
    assert one.startswith("root ::= "), one[:40]
    return 'root ::= tool_call_one ("\\n" tool_call_one)*\ntool_call_one ::= ' + one.removeprefix("root ::= ")


def _literal(text: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


__all__ = [
    "check_tools",
    "max_calls",
    "parses_tools",
    "renders_tools",
    "template_tools",
    "tool_choice",
    "tool_grammar",
    "tools_as_text",
]
