"""OpenAI's published response schemas as JSON Schema validators.

``data/openai_schemas.json`` is the part of OpenAI's ``openapi.yaml`` the tests use (source,
commit and licence in ``data/README.md``). The document marks optional values with OpenAPI
3.0's ``nullable``; JSON Schema does not know it, so it is rewritten first: ``type: X,
nullable: true`` is ``type: [X, "null"]``, and a nullable ``$ref``/``allOf`` is an ``anyOf``
with null.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from jsonschema import Draft202012Validator

SPEC = Path(__file__).resolve().parent / "data" / "openai_schemas.json"


def _denull(node: Any) -> Any:
    if isinstance(node, list):
        return [_denull(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _denull(v) for k, v in node.items()}
    if node.pop("nullable", False):
        if "type" in node:
            types = node["type"] if isinstance(node["type"], list) else [node["type"]]
            node["type"] = types + ["null"]
            if "enum" in node:
                node["enum"] = node["enum"] + [None]
        else:
            inner = {k: node.pop(k) for k in ("$ref", "allOf", "anyOf", "oneOf") if k in node}
            node["anyOf"] = [inner, {"type": "null"}]
    return node


class OpenAISchemas:
    def __init__(self, path: Path = SPEC) -> None:
        self.doc = _denull(orjson.loads(path.read_bytes()))

    def validator(self, name: str) -> Draft202012Validator:
        return Draft202012Validator({**self.doc, "$ref": f"#/components/schemas/{name}"})

    def validate(self, name: str, instance: Any) -> None:
        self.validator(name).validate(instance)

    def validate_response_event(self, event: dict) -> None:
        """A Responses stream event, against the schema of its own type (one of the
        ResponseStreamEvent alternatives: a failure then names the field, not just the union)."""
        if not hasattr(self, "_event_schemas"):
            schemas = self.doc["components"]["schemas"]
            names = [ref["$ref"].rsplit("/", 1)[-1] for ref in schemas["ResponseStreamEvent"]["anyOf"]]
            self._event_schemas = {schemas[n]["properties"]["type"]["enum"][0]: n for n in names}
        self.validate(self._event_schemas[event["type"]], event)

    def validate_completion_chunk(self, chunk: dict) -> None:
        """Streamed text completions reuse CreateCompletionResponse, whose finish_reason the spec
        marks non-null although it is null until a choice ends (as OpenAI itself sends it)."""
        patched = {**chunk, "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]}
        self.validate("CreateCompletionResponse", patched)
