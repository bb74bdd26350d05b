"""What a request's output constraints would cost the LLM replica's grammar compiler (xgrammar), checked at the
ingress with the cheap checks, before any schema is converted: a 400 for what would cost far more than a request
should. Measured on the tiny checkpoint's vocabulary: an object's optional properties compile in a time that grows
faster than the cube of their number (500: 0.09 s, 1,000: 1.6 s, 2,000: 18.6 s of a core; required ones: 2,000 in
0.05 s), and a 5 MB schema made 36 MB of grammar text at the ingress."""

from __future__ import annotations

import json
from collections.abc import Iterator

from deployments.ingress import client_json
from deployments.ingress.tools import tool_choice
from schemas import InvalidRequest
from schemas.config import Limits
from schemas.openai import ChatCompletionRequest
from schemas.requests import GenerationRequest


def check_cost(req: GenerationRequest, limits: Limits) -> None:
    """A 400 for what would cost the LLM replica's grammar compiler far more than a request should: schemas,
    grammars and regexes over `limits.max_schema_bytes` together, or an object with more properties that are not
    required than `limits.max_optional_properties` (xgrammar lets each be followed by any later one)."""
    total, first = 0, None
    for param, value in _constraints(req):
        total += len(value.encode() if isinstance(value, str) else json.dumps(value).encode())
        first = first or param
        if param == "structured_outputs.json" and isinstance(value, str):  # a schema as JSON text
            try:
                value = client_json.loads(value, param, param)
            except client_json.NotJson:
                pass  # xgrammar refuses it when it is converted, in its words
        if isinstance(value, dict) and (worst := _most_optional(value)) > limits.max_optional_properties:
            raise InvalidRequest(
                f"{param}: an object has {worst} properties that are not required, over the limit of "
                f"{limits.max_optional_properties} (list them in `required`, or split the object)",
                param=param,
            )
    if total > limits.max_schema_bytes:
        raise InvalidRequest(
            f"the request's schemas and grammars are {total} bytes together, over the limit of "
            f"{limits.max_schema_bytes}",
            param=first,
        )


def _constraints(req: GenerationRequest) -> Iterator[tuple[str, object]]:
    """(param, schema or text) of each output constraint the request carries, the tools' parameters that a
    required or named tool choice compiles included."""
    fmt, vllm = req.response_format, req.structured_outputs
    if fmt is not None and fmt.json_schema is not None:
        yield "response_format.json_schema.schema", fmt.json_schema.json_schema
    if vllm is not None:
        for kind in ("json_", "regex", "grammar", "choice"):
            if (value := getattr(vllm, kind)) is not None:
                yield f"structured_outputs.{kind.rstrip('_')}", value
    if isinstance(req, ChatCompletionRequest) and (choice := tool_choice(req)) in ("required", "named"):
        for i, tool in enumerate(req.tools):  # only these are compiled; under "auto" they are prompt text
            if choice == "required" or tool.function.name == req.tool_choice.function.name:
                yield f"tools[{i}].function.parameters", tool.function.parameters


def _most_optional(schema: dict) -> int:
    """The most properties that are not required in any one object of `schema` (walked without recursion: the
    body's nesting may be deeper than Python's stack)."""
    worst, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            props, required = node.get("properties"), node.get("required")
            if isinstance(props, dict):
                named = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
                worst = max(worst, len(props.keys() - named))
            stack += node.values()
        elif isinstance(node, list):
            stack += node
    return worst


__all__ = ["check_cost"]
