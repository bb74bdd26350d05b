"""OpenAI's published response schemas (a vendored subset, see refresh.py) as JSON Schema validators."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC = Path(__file__).with_name("openai.json")
URI = "urn:openai-openapi"


def from_openapi(node: Any) -> Any:
    """OpenAPI 3.0's `nullable: true` as JSON Schema. OpenAI's 3.1 document still uses it in places (the stream
    chunk's `finish_reason`, `logprobs` and `usage`), where a plain JSON Schema validator would ignore it and
    reject the nulls the API sends. An `anyOf` with null, not `type: [x, "null"]`: an `enum` or a `$ref` beside
    it would still refuse null."""
    if isinstance(node, list):
        return [from_openapi(v) for v in node]
    if not isinstance(node, dict):
        return node
    nullable = node.get("nullable") is True  # a field named "nullable" would map to a schema, not to True
    node = {k: from_openapi(v) for k, v in node.items() if not (k == "nullable" and isinstance(v, bool))}
    return {"anyOf": [node, {"type": "null"}]} if nullable else node


@functools.cache
def document() -> dict[str, Any]:
    return from_openapi(json.loads(SPEC.read_text()))


@functools.cache
def validator(name: str) -> Draft202012Validator:
    """A validator of `#/components/schemas/<name>`; the `$ref`s inside resolve within the vendored document."""
    if name not in document()["components"]["schemas"]:
        raise KeyError(f"{name} is not vendored; add it to refresh.ROOTS and refresh")
    registry = Registry().with_resource(URI, Resource(contents=document(), specification=DRAFT202012))
    return Draft202012Validator({"$ref": f"{URI}#/components/schemas/{name}"}, registry=registry)


def errors(name: str, instance: Any) -> list[str]:
    """Each violation as "<JSON path>: <message>", the most specific branch of an anyOf/oneOf."""
    found = []
    for error in validator(name).iter_errors(instance):
        best = best_match([error])
        found.append(f"{best.json_path}: {best.message}")
    return sorted(found)


def assert_valid(name: str, instance: Any) -> None:
    problems = errors(name, instance)
    assert not problems, f"not a valid {name}:\n  " + "\n  ".join(problems) + f"\n{json.dumps(instance)[:2000]}"


__all__ = ["assert_valid", "document", "errors", "from_openapi", "validator"]
