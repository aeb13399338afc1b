"""The HTTP front's OpenAPI 3.1 document (``GET /openapi.json``), built from the pydantic
models that :func:`~triton_disagg.front.openai_api.parse` validates with (their JSON schema,
:func:`~triton_disagg.front.openai_models.request_model` with the served engine's bounds),
so the document says exactly what the front accepts.

Invariant: every route the front serves is in it, every request body is the endpoint's
model's schema (unknown fields refused), and every error is OpenAI's error object.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from triton_disagg import __version__
from triton_disagg.front.openai_models import EngineLimits, request_model

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_ANY_JSON = {"application/json": {"schema": {"type": "object"}}}
_ERRORS = {"default": {"description": "OpenAI's error object",
                       "content": {"application/json": {"schema": {"$ref":
                                                                   "#/components/schemas/Error"}}}}}
_GENERATION = {  # path -> (endpoint for request_model, summary)
    "/v1/completions": ("completions", "OpenAI completions (SSE with stream true)"),
    "/v1/chat/completions": ("chat", "OpenAI chat completions (SSE with stream true)"),
    "/v1/inference": ("inference", "the deployment guide's request"),
}
_GETS = {  # path -> summary
    "/v1/models": "the served model, as OpenAI's list",
    "/v1/models/{model}": "the served model (404 for another)",
    "/healthz": "200 when the server and its models are ready, else 503 with the reason",
    "/health": "as /healthz",
    "/metrics": "the front's own metrics (Prometheus text)",
    "/version": "this server's version and model",
    "/openapi.json": "this document",
    "/tokenizer_info": "vLLM's: the tokenizer's configuration (special tokens, chat template)",
}


def document(limits: EngineLimits,
             posts: Mapping[str, tuple[str, type[BaseModel], str]] = {}) -> dict:
    """The OpenAPI document of a front serving an engine of ``limits``, with the further POST
    routes ``posts`` (path -> operation id, body model, summary)."""
    bodies = {path: (endpoint, request_model(endpoint, limits), summary)
              for path, (endpoint, summary) in _GENERATION.items()} | dict(posts)
    refs, schemas = models_json_schema([(m, "validation") for _, m, _ in bodies.values()],
                                       ref_template="#/components/schemas/{model}")
    paths: dict[str, dict] = {}
    for path, (operation, model, summary) in bodies.items():
        paths[path] = {"post": {
            "summary": summary, "operationId": operation,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": refs[model, "validation"]}}},
            "responses": {"200": {"description": "the answer (text/event-stream when "
                                                 "streamed)", "content": _ANY_JSON}, **_ERRORS}}}
    for path, summary in _GETS.items():
        parameters = ([{"name": "model", "in": "path", "required": True,
                        "schema": {"type": "string"}}] if "{model}" in path else [])
        paths[path] = {"get": {"summary": summary, "parameters": parameters,
                               "operationId": "get_" + path.strip("/").replace("/", "_")
                               .replace("{", "").replace("}", "").replace(".", "_"),
                               "responses": {"200": {"description": summary}, **_ERRORS}}}
    return {"openapi": "3.1.0",
            "info": {"title": "triton-disagg HTTP front", "version": __version__},
            "paths": paths, "components": {"schemas": {**schemas["$defs"], "Error": _ERROR}}}
