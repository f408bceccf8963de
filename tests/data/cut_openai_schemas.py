"""Cut ``openai_schemas.json`` out of OpenAI's ``openapi.yaml`` (see README.md): the named
response schemas and every schema they reference, unchanged, as JSON.

    python tests/data/cut_openai_schemas.py path/to/openapi.yaml

(Not run by the tests: they read the JSON this writes.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

ROOTS = ("CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "CreateCompletionResponse",
         "ListModelsResponse", "ErrorResponse", "Response", "ResponseStreamEvent", "ResponseItemList")


def references(node, found: set[str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                found.add(value.rsplit("/", 1)[-1])
            else:
                references(value, found)
    elif isinstance(node, list):
        for value in node:
            references(value, found)


def cut(document: dict) -> dict:
    schemas = document["components"]["schemas"]
    kept: set[str] = set()
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in kept:
            kept.add(name)
            found: set[str] = set()
            references(schemas[name], found)
            todo.extend(found - kept)
    return {"openapi": document["openapi"], "info": document["info"],
            "components": {"schemas": {name: schemas[name] for name in sorted(kept)}}}


if __name__ == "__main__":
    source = yaml.load(Path(sys.argv[1]).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    out = Path(__file__).resolve().parent / "openai_schemas.json"
    out.write_text(json.dumps(cut(source), indent=1, sort_keys=True) + "\n")
