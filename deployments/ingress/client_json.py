"""JSON from the client, the body and the JSON that its strings hold (a tool call's arguments, a schema as text):
a 400 for what json.loads reads but what comes after it cannot take. Nesting past MAX_JSON_DEPTH (json.dumps, the
chat template and pickling recurse per level, and xgrammar's conversion of a schema grows with the cube of its depth:
objects nested 200 deep took 1.1 s of a core here, 400 deep 8.7 s (16 KB of schema), and 48 deep, what the limit
lets through, 0.02 s) and an unpaired UTF-16 surrogate escape ("\\ud800", which json.loads keeps and no tokenizer
encodes)."""

from __future__ import annotations

import json
import re
from typing import Any

from schemas import InvalidRequest

MAX_JSON_DEPTH = 100  # arrays and objects, one in another; a real request nests under 20 (a schema's object: 2 each)

# A surrogate reaches a string only as a \u escape (raw UTF-8 cannot encode one): strings are looked at only in a text
# with such an escape (an emoji's pair, often). Measured here: on a 10 MB image body json.loads takes 5-13 ms, the
# search for a backslash 0.1 ms (base64 has none), the regex's 2.4 ms, counting brackets 6 ms, the walk of its few
# containers 0.01 ms; on a prompt of 100,000 token ids json.loads 5 ms, the walk 4 ms.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class NotJson(InvalidRequest):
    """A 400: the text is not JSON at all."""


def loads(text: bytes | str, what: str, param: str | None = None) -> Any:
    """json.loads, with a 400 naming `what` (and `param`) for text that is not JSON (NotJson) or that _check()
    refuses."""
    try:  # NOTE: ValueError: JSONDecodeError, UnicodeDecodeError, and an integer of over 4,300 digits (CPython's cap)
        value = json.loads(text)
    except ValueError as e:
        raise NotJson(f"{what} is not valid JSON: {e}", param=param) from e
    except RecursionError as e:  # json's decoder recurses per level: [[[[...]]]] a few thousand deep
        raise _too_deep(what, param) from e
    _check(value, text, what, param)
    return value


def _check(value: Any, text: bytes | str, what: str, param: str | None = None) -> None:
    """A 400 for `value`, parsed from `text`, nested deeper than MAX_JSON_DEPTH or holding an unpaired surrogate."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    surrogates = b"\\" in raw and _SURROGATE_ESCAPE.search(raw) is not None  # memchr first
    walked = (str, dict, list) if surrogates else (dict, list)
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):  # walked only when the text has a surrogate's escape
            if not _encodes(node):
                raise InvalidRequest(
                    f"{what} has a string with an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)", param=param
                )
        elif isinstance(node, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep(what, param)
            items = node if isinstance(node, list) else [*node, *node.values()] if surrogates else node.values()
            stack += [(child, depth + 1) for child in items if isinstance(child, walked)]


def _too_deep(what: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(f"{what} is nested too deeply (over {MAX_JSON_DEPTH} levels)", param=param)


def _encodes(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


__all__ = ["MAX_JSON_DEPTH", "NotJson", "loads"]
