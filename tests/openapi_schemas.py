"""OpenAI's published schemas (../shared/openai/openapi.yaml) as JSON Schema validators.

The document marks optional values with OpenAPI 3.0's ``nullable``; JSON Schema does not
know it, so it is rewritten first (see shared/openai/README.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator

SPEC = Path(__file__).resolve().parents[2] / "shared" / "openai" / "openapi.yaml"


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
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        self.doc = _denull(yaml.load(path.read_text(), Loader=loader))

    def validator(self, name: str) -> Draft202012Validator:
        return Draft202012Validator({**self.doc, "$ref": f"#/components/schemas/{name}"})

    def validate(self, name: str, instance: Any) -> None:
        self.validator(name).validate(instance)

    def validate_completion_chunk(self, chunk: dict) -> None:
        """Streamed text completions reuse CreateCompletionResponse, whose finish_reason the spec
        marks non-null although it is null until a choice ends (as OpenAI itself sends it)."""
        patched = {**chunk, "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]}
        self.validate("CreateCompletionResponse", patched)
