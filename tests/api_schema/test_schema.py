"""The vendored OpenAI schemas: complete, faithful to the spec's intent on nulls, and regenerable."""

from __future__ import annotations

import json

from jsonschema import Draft202012Validator

from tests.api_schema import SPEC, document, errors, from_openapi
from tests.api_schema.refresh import PREFIX, ROOTS, closure, main

CHUNK = {
    "id": "c",
    "object": "chat.completion.chunk",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}],
}


def test_every_root_and_every_reference_is_vendored():
    vendored = json.loads(SPEC.read_text())
    schemas = vendored["components"]["schemas"]
    assert closure(schemas, ROOTS) == sorted(schemas)  # nothing missing (closure raises), nothing extra
    assert vendored["x-vendored"]["repository"] == "openai/openai-openapi"
    assert len(vendored["x-vendored"]["commit"]) == 40


def test_nullable_fields_accept_null_and_only_null():
    # The stream chunk's finish_reason is `type: string, enum: [...], nullable: true`: OpenAPI 3.0 style in a 3.1
    # document. Read as plain JSON Schema, every chunk before the last would be off-spec.
    raw = json.loads(SPEC.read_text())
    plain = Draft202012Validator(
        {"$ref": "#/components/schemas/CreateChatCompletionStreamResponse", "components": raw["components"]}
    )
    assert not plain.is_valid(CHUNK)
    assert errors("CreateChatCompletionStreamResponse", CHUNK) == []
    wrong = {**CHUNK, "choices": [{**CHUNK["choices"][0], "finish_reason": "tired"}]}
    assert errors("CreateChatCompletionStreamResponse", wrong)


def test_from_openapi_keeps_a_field_named_nullable():
    schema = {"type": "object", "properties": {"nullable": {"type": "boolean"}}, "nullable": True}
    assert from_openapi(schema) == {
        "anyOf": [{"type": "object", "properties": {"nullable": {"type": "boolean"}}}, {"type": "null"}]
    }
    assert "nullable" not in json.dumps(document()["components"]["schemas"]["CreateChatCompletionStreamResponse"])


def test_refresh_extracts_the_closure_and_drops_only_annotations(tmp_path):
    spec = {
        "openapi": "3.1.0",
        "info": {"version": "9.9"},
        "components": {
            "schemas": {
                "Root": {
                    "type": "object",
                    "description": "prose",
                    "example": {"a": 1},
                    "properties": {"description": {"$ref": f"{PREFIX}Leaf"}, "title": {"type": "string"}},
                },
                "Leaf": {"anyOf": [{"$ref": f"{PREFIX}Deeper"}, {"type": "null"}], "title": "Leaf"},
                "Deeper": {"type": "integer"},
                "Unrelated": {"type": "string"},
            }
        },
    }
    (tmp_path / "openapi.json").write_text(json.dumps(spec))
    out = tmp_path / "subset.json"
    main([str(tmp_path / "openapi.json"), "--commit", "abc", "--out", str(out), "--roots", "Root"])
    got = json.loads(out.read_text())
    assert got["x-vendored"] | {"roots": None} == {
        "repository": "openai/openai-openapi",
        "path": "openapi.json",
        "commit": "abc",
        "openapi": "3.1.0",
        "version": "9.9",
        "roots": None,
        "regenerate": got["x-vendored"]["regenerate"],
    }
    assert got["components"]["schemas"] == {
        "Root": {
            "type": "object",
            "properties": {"description": {"$ref": f"{PREFIX}Leaf"}, "title": {"type": "string"}},
        },
        "Leaf": {"anyOf": [{"$ref": f"{PREFIX}Deeper"}, {"type": "null"}]},
        "Deeper": {"type": "integer"},
    }
