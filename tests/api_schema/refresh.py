"""Regenerate the vendored subset of OpenAI's OpenAPI description (tests/api_schema/openai.json).

    git clone https://github.com/openai/openai-openapi && cd openai-openapi
    python -m tests.api_schema.refresh openapi.json --commit "$(git rev-parse HEAD)"

It keeps the named response schemas and every schema they reference, transitively, under the same
`#/components/schemas/` paths (so the `$ref`s resolve unchanged), and drops prose and examples, which
validate nothing. The file is vendored, not fetched, so `make test` runs offline and a spec change upstream
shows up as a reviewed diff, not as a red test out of nowhere.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOTS = (
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "ErrorResponse",
    "ListModelsResponse",
    "Model",
    "CreateCompletionResponse",
    # POST /v1/responses: the object, and the stream events this server sends
    "Response",
    "ResponseCreatedEvent",
    "ResponseInProgressEvent",
    "ResponseCompletedEvent",
    "ResponseIncompleteEvent",
    "ResponseOutputItemAddedEvent",
    "ResponseOutputItemDoneEvent",
    "ResponseContentPartAddedEvent",
    "ResponseContentPartDoneEvent",
    "ResponseTextDeltaEvent",
    "ResponseTextDoneEvent",
    "ResponseFunctionCallArgumentsDeltaEvent",
    "ResponseFunctionCallArgumentsDoneEvent",
    "ResponseErrorEvent",
)
PREFIX = "#/components/schemas/"
OUT = Path(__file__).with_name("openai.json")
# Annotations only: no JSON Schema validator reads them.
DROP = frozenset({"description", "example", "examples", "x-oaiMeta", "x-oaiExpandable", "title"})


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def closure(schemas: dict[str, Any], roots: tuple[str, ...]) -> list[str]:
    """The roots and every schema they reference, transitively, sorted."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        if name not in schemas:
            raise KeyError(f"schema {name!r} is referenced but not in the spec")
        seen.add(name)
        for ref in refs(schemas[name]):
            if not ref.startswith(PREFIX):
                raise ValueError(f"{name}: only local schema references are supported, not {ref!r}")
            todo.append(ref.removeprefix(PREFIX))
    return sorted(seen)


def strip(node: Any, in_properties: bool = False) -> Any:
    """`node` without annotations. Under `properties` the keys are field names (a field may be called
    `description`), so they are kept there."""
    if isinstance(node, dict):
        return {
            k: strip(v, k == "properties" and not in_properties)
            for k, v in node.items()
            if in_properties or k not in DROP
        }
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def subset(spec: dict[str, Any], source: dict[str, str], roots: tuple[str, ...] = ROOTS) -> dict[str, Any]:
    schemas = spec["components"]["schemas"]
    return {
        "x-vendored": {
            **source,
            "openapi": spec.get("openapi"),
            "version": spec.get("info", {}).get("version"),
            "roots": list(roots),
            "regenerate": "python -m tests.api_schema.refresh SPEC --commit SHA",
        },
        "components": {"schemas": {name: strip(schemas[name]) for name in closure(schemas, roots)}},
    }


def load(path: Path) -> dict[str, Any]:
    if path.suffix == ".json":
        return json.loads(path.read_text())
    import yaml  # only for the YAML edition of the spec; ray depends on it

    return yaml.safe_load(path.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", type=Path, help="openapi.json (or .yaml) of github.com/openai/openai-openapi")
    parser.add_argument("--commit", required=True, help="the commit of openai/openai-openapi the spec comes from")
    parser.add_argument("--repository", default="openai/openai-openapi")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--roots", nargs="+", default=list(ROOTS), help="schemas to keep (with their references)")
    args = parser.parse_args(argv)
    source = {"repository": args.repository, "path": args.spec.name, "commit": args.commit}
    args.out.write_text(json.dumps(subset(load(args.spec), source, tuple(args.roots)), indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
