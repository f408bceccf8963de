"""The server's own OpenAPI document (``/openapi.json``), derived from the request classes.

Request bodies come from the attrs classes in ``api.protocol`` (their type hints; a field's
``metadata["schema"]`` where a hook accepts more shapes than the hint says), so the document
cannot drift from what the parser accepts. Range rules live in ``SamplingParams`` and are
not repeated here: a value out of range is a 400 naming the field.
"""

from __future__ import annotations

import types
import typing
from typing import Any

import attrs

from api.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ResponsesRequest,
                          TokenizeRequest)

_SCALARS = {int: {"type": "integer"}, float: {"type": "number"}, bool: {"type": "boolean"}, str: {"type": "string"}}


def json_schema(hint: Any) -> dict[str, Any]:
    """JSON Schema of a type hint as the request classes use them."""
    if hint in _SCALARS:
        return dict(_SCALARS[hint])
    if hint is Any or hint is dict:
        return {}
    if attrs.has(hint):
        return object_schema(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        options = [json_schema(a) for a in args if a is not type(None)]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return {"anyOf": [schema, {"type": "null"}]} if type(None) in args else schema
    if origin is list:
        return {"type": "array", "items": json_schema(args[0]) if args else {}}
    if origin is dict:
        return {"type": "object", "additionalProperties": json_schema(args[1]) if args else {}}
    raise TypeError(f"no JSON Schema for {hint!r}")


def object_schema(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    properties = {f.name: f.metadata.get("schema") or json_schema(hints[f.name]) for f in attrs.fields(cls)}
    for f in attrs.fields(cls):  # (null is the default for a field that has one: api.protocol)
        schema = properties[f.name]
        if f.default is not attrs.NOTHING and f.default is not None and {"type": "null"} not in schema.get("anyOf", ()):
            properties[f.name] = {"anyOf": [schema, {"type": "null"}]}
    required = [f.name for f in attrs.fields(cls) if f.default is attrs.NOTHING]
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


_ERROR = {"description": "OpenAI's error shape", "content": {"application/json": {"schema": {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}}}}


def _ref(cls: type) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{cls.__name__}"}


def _post(summary: str, body: type | dict[str, Any], generation: bool) -> dict[str, Any]:
    """A POST of a JSON body: a request class's, or a schema."""
    responses = {"200": {"description": "the result (an event stream when stream is true)" if generation
                         else "the result"},
                 "400": _ERROR, "401": _ERROR, "404": _ERROR, "413": _ERROR, "503": _ERROR}
    if generation:
        responses.update({"500": _ERROR, "504": _ERROR})
    schema = _ref(body) if isinstance(body, type) else body
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": schema}}}, "responses": responses}}


def _get(summary: str, content_type: str = "application/json") -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": summary, "content": {content_type: {}}}}}}


def _stored_response() -> dict[str, Any]:
    """GET and DELETE of a stored response (404 unless the server keeps them)."""
    parameters = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    responses = {"200": {"description": "the response (GET) or its deletion (DELETE)",
                         "content": {"application/json": {}}}, "401": _ERROR, "404": _ERROR}
    return {"get": {"summary": "A stored response", "parameters": parameters, "responses": responses},
            "delete": {"summary": "Delete a stored response", "parameters": parameters, "responses": responses}}


def _stored_response_part(method: str, summary: str, query: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    """An operation on a stored response: its cancel (400: only background responses, which
    this server makes none of) or its input items, a page at a time."""
    parameters = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}, *query]
    return {method: {"summary": summary, "parameters": parameters, "responses": {
        "200": {"description": summary, "content": {"application/json": {}}}, "400": _ERROR, "401": _ERROR,
        "404": _ERROR}}}


_PAGE = ({"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
         {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
         {"name": "after", "in": "query", "schema": {"type": "string"}})


def _model() -> dict[str, Any]:
    """GET of one model by id (OpenAI's retrieve model; 404 model_not_found for another id)."""
    parameters = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    return {"get": {"summary": "The served model, by id", "parameters": parameters,
                    "responses": {"200": {"description": "the model", "content": {"application/json": {}}},
                                  "401": _ERROR, "404": _ERROR}}}


def openapi_document(version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of this server's endpoints."""
    requests = (ChatCompletionRequest, CompletionRequest, ResponsesRequest, TokenizeRequest, DetokenizeRequest)
    return {
        "openapi": "3.1.0",
        "info": {"title": "trio-llm-engine", "version": version,
                 "description": "An OpenAI-compatible API. /v1/* takes `Authorization: Bearer KEY` when the "
                                "server was started with --api-key; /health and /metrics never do."},
        "paths": {
            "/v1/chat/completions": _post("Create a chat completion", ChatCompletionRequest, True),
            "/v1/completions": _post("Create a text completion", CompletionRequest, True),
            "/v1/responses": _post("Create a response (OpenAI's Responses API)", ResponsesRequest, True),
            "/v1/responses/{response_id}": _stored_response(),
            "/v1/responses/{response_id}/cancel": _stored_response_part("post", "Cancel a background response"),
            "/v1/responses/{response_id}/input_items": _stored_response_part(
                "get", "A stored response's input items", _PAGE),
            "/tokenize": _post("Token ids of a prompt or a conversation", TokenizeRequest, False),
            "/detokenize": _post("Text of token ids", DetokenizeRequest, False),
            "/v1/models": _get("The served model"),
            "/v1/models/{model}": _model(),
            "/health": _get("200 when ready; 503 while loading, draining or after an engine failure", "text/plain"),
            "/version": _get("The server's version"),
            "/ping": {**_get("SageMaker's health check: /health's answer", "text/plain"),
                      "post": _get("SageMaker's health check: /health's answer", "text/plain")["get"]},
            "/invocations": _post("SageMaker's inference: a chat completion or a text completion, by the body",
                                  {"anyOf": [_ref(ChatCompletionRequest), _ref(CompletionRequest)]}, True),
            "/metrics": _get("Prometheus metrics", "text/plain"),
            "/v1/engine/stats": _get("The engine's live counters (requests running and waiting, KV cache "
                                     "usage, tokens per second): numbers only, never a request's text"),
        },
        "components": {"schemas": {cls.__name__: object_schema(cls) for cls in requests},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


# The interactive docs page: Swagger UI from a CDN, pointed at /openapi.json.
DOCS_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>trio-llm-engine API</title>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#ui"});</script>
</body></html>
"""
