"""Structured outputs at the ingress: a request's `response_format` (or vLLM's `structured_outputs`) -> the xgrammar
EBNF grammar its output must match, which the LLM replica compiles against its vocabulary (llm/engine/grammar.py).
Made here, before any image or LLM work, so that a schema xgrammar refuses is a 400 that costs nothing else."""

from __future__ import annotations

import functools
import json

import xgrammar as xgr

from schemas import InvalidRequest
from schemas.requests import GenerationRequest


@functools.lru_cache(maxsize=256)
def _json_grammar(schema: str) -> str:
    # NOTE: no whitespace between tokens beyond json.dumps' ", " and ": " (vLLM's disable-any-whitespace): free
    # whitespace lets a weak model run away in newlines and never close the object.
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    # NOTE: xgrammar 0.2.8 writes the characters of a string with minLength/maxLength as _BOUNDED_STRING_CHAR, which
    # lets control characters through (json.loads and pydantic refuse them); its unbounded strings exclude \0-\x1f.
    return ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR = r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]"


def json_grammar(schema: object, param: str) -> str:
    """The grammar of JSON values valid under `schema` (a dict, True, or its JSON text); a 400 naming `param` when
    xgrammar cannot convert it."""
    text = schema if isinstance(schema, str) else json.dumps(schema)  # key order kept: properties come in it
    try:
        return _json_grammar(text)
    except (RuntimeError, ValueError) as e:
        raise InvalidRequest(f"{param}: the JSON schema is not supported: {_reason(e)}", param=param) from e


def _reason(e: Exception) -> str:
    """xgrammar's message without its source location prefix (`[12:00:00] /project/cpp/file.cc:12: `)."""
    return str(e).strip().rsplit(": ", 1)[-1] if str(e).startswith("[") else str(e).strip()


def response_grammar(req: GenerationRequest) -> str | None:
    """The grammar the request's answer must match, or None for free text."""
    fmt, vllm = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":  # vLLM's: any JSON object
            return json_grammar({"type": "object"}, "response_format")
        assert fmt.json_schema is not None  # the request model checks it
        return json_grammar(fmt.json_schema.json_schema, "response_format.json_schema.schema")
    if vllm is None:
        return None
    given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(vllm, k) is not None]
    if len(given) != 1:
        raise InvalidRequest(
            "structured_outputs takes exactly one of json, regex, choice, grammar", param="structured_outputs"
        )
    kind = given[0]
    param = f"structured_outputs.{kind.rstrip('_')}"
    if kind == "json_":
        return json_grammar(vllm.json_, param)
    try:
        if kind == "regex":
            return str(xgr.Grammar.from_regex(vllm.regex))
        if kind == "choice":  # one of the strings, exactly
            return str(xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in vllm.choice)))
        return str(xgr.Grammar.from_ebnf(vllm.grammar))
    except (RuntimeError, ValueError) as e:
        raise InvalidRequest(f"{param}: {_reason(e)}", param=param) from e


__all__ = ["json_grammar", "response_grammar"]
