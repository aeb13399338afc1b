"""The HTTP front's OpenAPI 3.1 document (``GET /openapi.json``), built from the same field
checks that :func:`~triton_disagg.front.openai_api.parse` runs (their ``json_schema``), with
the served engine's bounds, so the document says exactly what the front accepts.

Invariant: every route the front serves is in it, every request body is the endpoint's
:func:`~triton_disagg.front.openai_api.body_schema` (unknown fields refused), and every
error is OpenAI's error object.
"""

from __future__ import annotations

from triton_disagg import __version__
from triton_disagg.front.openai_api import EngineLimits, body_schema

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_ANY_JSON = {"application/json": {"schema": {"type": "object"}}}
_ERRORS = {"default": {"description": "OpenAI's error object",
                       "content": {"application/json": {"schema": {"$ref":
                                                                   "#/components/schemas/Error"}}}}}
_GENERATION = {  # path -> (endpoint for body_schema, summary)
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
}


def document(limits: EngineLimits) -> dict:
    """The OpenAPI document of a front serving an engine of ``limits``."""
    paths: dict[str, dict] = {}
    for path, (endpoint, summary) in _GENERATION.items():
        name = f"{endpoint.capitalize()}Request"
        paths[path] = {"post": {
            "summary": summary, "operationId": endpoint,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{name}"}}}},
            "responses": {"200": {"description": "the answer (text/event-stream when "
                                                 "streamed)", "content": _ANY_JSON}, **_ERRORS}}}
    for path, summary in _GETS.items():
        parameters = ([{"name": "model", "in": "path", "required": True,
                        "schema": {"type": "string"}}] if "{model}" in path else [])
        paths[path] = {"get": {"summary": summary, "parameters": parameters,
                               "operationId": "get_" + path.strip("/").replace("/", "_")
                               .replace("{", "").replace("}", "").replace(".", "_"),
                               "responses": {"200": {"description": summary}, **_ERRORS}}}
    schemas = {f"{endpoint.capitalize()}Request": body_schema(endpoint, limits)
               for endpoint, _ in _GENERATION.values()}
    return {"openapi": "3.1.0",
            "info": {"title": "triton-disagg HTTP front", "version": __version__},
            "paths": paths, "components": {"schemas": {**schemas, "Error": _ERROR}}}
