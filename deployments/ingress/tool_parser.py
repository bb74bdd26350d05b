"""Tool calls parsed out of an answer's text, whole or as it streams, in the hermes format Qwen2.5's chat template
teaches: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. The idea is vLLM's `hermes` tool parser:
the blocks between the tags are JSON calls, the text outside them is the content. A block that is not a JSON call
(malformed, no name) stays in the content as it was written, as vLLM returns such an answer as plain text. With
`max_calls` (1 under `parallel_tool_calls: false`), calls past it are dropped, neither calls nor content: vLLM's rule
(it returns the first call alone, whatever the model wrote)."""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field

from schemas.openai import FunctionDelta, ResponseFunction, ResponseToolCall, ToolCallDelta

START, END = "<tool_call>", "</tool_call>"
_ALNUM = string.ascii_letters + string.digits


def call_id() -> str:
    """OpenAI's form: call_ and 24 alphanumerics."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=call_id)

    def response(self) -> ResponseToolCall:
        return ResponseToolCall(id=self.id, function=ResponseFunction(name=self.name, arguments=self.arguments))

    def deltas(self, index: int) -> tuple[ToolCallDelta, ToolCallDelta]:
        """OpenAI's stream of call `index` of its choice: id, type and name first, then the arguments."""
        return (
            ToolCallDelta(
                index=index, id=self.id, type="function", function=FunctionDelta(name=self.name, arguments="")
            ),
            ToolCallDelta(index=index, function=FunctionDelta(arguments=self.arguments)),
        )


def _call(block: str) -> ParsedCall | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    # NOTE: json.dumps' separators are the grammar's (", " and ": "), so a constrained call's arguments come back
    # as the model wrote them; ensure_ascii=False keeps non-ASCII text as text, as vLLM's hermes parser does.
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _held(text: str) -> int:
    """How many characters at the end of `text` may be the start of a `<tool_call>` tag."""
    for n in range(min(len(text), len(START) - 1), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """One choice's text, fed in any pieces -> content to send and calls as they complete. The content is the text
    outside the calls with its leading and trailing whitespace dropped; whatever the pieces, what the feeds and the
    finish return, joined, is what one feed of the whole text and the finish return (parse()). `max_calls`: the
    most calls kept (None: all)."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.calls: list[ParsedCall] = []
        self._buffer = ""  # text not decided yet: a possible tag start, or an open block
        self._in_block = False
        self._started = False  # content sent yet (before it, whitespace is dropped)
        self._space = ""  # trailing whitespace of the content, held until more content follows it

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(content, calls) that `text` completes."""
        buffer, content, calls = self._buffer + text, [], []
        while True:
            if not self._in_block:
                i = buffer.find(START)
                if i < 0:
                    cut = len(buffer) - _held(buffer)
                    content.append(buffer[:cut])
                    self._buffer = buffer[cut:]
                    break
                content.append(buffer[:i])
                buffer, self._in_block = buffer[i + len(START) :], True
            else:
                j = buffer.find(END)
                if j < 0:
                    self._buffer = buffer
                    break
                self._close(buffer[:j], content, calls)
                buffer, self._in_block = buffer[j + len(END) :], False
        return self._content("".join(content)), calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """What the end of the text decides: an unclosed block is a call if its JSON is whole (as vLLM's)."""
        content: list[str] = []
        calls: list[ParsedCall] = []
        if self._in_block:
            self._close(self._buffer, content, calls, closed=False)
        else:
            content.append(self._buffer)
        self._buffer, self._in_block = "", False
        out = self._content("".join(content))
        self._space = ""  # trailing whitespace is dropped
        return out, calls

    def _close(self, block: str, content: list[str], calls: list[ParsedCall], closed: bool = True) -> None:
        call = _call(block)
        if call is None:
            content.append(START + block + (END if closed else ""))
        elif self.max_calls is None or len(self.calls) < self.max_calls:
            calls.append(call)
            self.calls.append(call)

    def _content(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._space + text
        kept = text.rstrip()
        self._space = text[len(kept) :]
        return kept


def parse(text: str, max_calls: int | None = None) -> tuple[str | None, list[ParsedCall]]:
    """A whole answer -> (its content, None when empty; its calls, at most `max_calls`)."""
    parser = ToolCallParser(max_calls)
    content, _ = parser.feed(text)
    rest, _ = parser.finish()
    return (content + rest) or None, parser.calls


def split_delta(parser: ToolCallParser | None, text: str, finished: bool) -> tuple[str, list[ParsedCall]]:
    """A delta's text that is surely no call, and the calls it completed (at the finish, what the parser held);
    without a parser (no tools), the text as it is."""
    if parser is None:
        return text, []
    text, calls = parser.feed(text)
    if finished:
        rest, more = parser.finish()
        text, calls = text + rest, calls + more
    return text, calls


__all__ = ["END", "ParsedCall", "START", "ToolCallParser", "call_id", "parse", "split_delta"]
