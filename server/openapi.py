"""The OpenAPI schema at /openapi.json, rewritten to say what the server really sends.

FastAPI documents a 422 for every route with a body or a path parameter, but the
error handlers turn validation errors into 400s, and it knows nothing of the
statuses the middleware and the handlers send (401, 404, 408, 429, 503) nor of
streamed responses. `document_api` replaces `app.openapi` with a function that
builds FastAPI's schema once and rewrites it: no 422, the OpenAI error body for
each error status a route can answer, `text/event-stream` beside JSON for the
generation routes, the probes' own bodies, and the bearer scheme when a key is set.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

ERROR = "ErrorResponse"
PROBE = "ProbeStatus"
_FASTAPI_VALIDATION = ("HTTPValidationError", "ValidationError")
_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_PROBE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["status"],
    "properties": {"status": {"type": "string"}},
}
_WHY = {
    400: "Invalid request: a bad parameter, a body that is not JSON or is too large",
    401: "Missing or wrong API key (`Authorization: Bearer <key>`)",
    404: "Unknown model, or no stored response of that id",
    408: "The request body did not arrive within the body read timeout",
    429: "The queue is full; retry after the `Retry-After` seconds",
    503: "Not ready yet, draining for shutdown, or the engine failed",
}
_GENERATION_ERRORS = (400, 404, 408, 429, 503)
_PROBES = {
    "/health": "The model is loaded and its engine alive (503: still loading, or failed)",
    "/ping": "SageMaker's health check: /health's answer",
    "/ready": "The model is loaded and warm (503: starting, draining or failed)",
}


def document_api(app: FastAPI, *, api_key_required: bool) -> None:
    """Serve the rewritten schema from `app.openapi()` (and so at /openapi.json)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:  # FastAPI's `build` caches there too: rewrite once
            app.openapi_schema = rewrite(build(), api_key_required=api_key_required)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def rewrite(schema: dict[str, Any], *, api_key_required: bool) -> dict[str, Any]:
    """`schema` (FastAPI's) with every route's responses as the server sends them."""
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas[ERROR] = _ERROR_SCHEMA
    schemas[PROBE] = _PROBE_SCHEMA
    if api_key_required:
        components["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if path in _PROBES:
                _probe(responses, _PROBES[path])
                continue
            statuses: list[int] = []
            if api_key_required:  # every route but the probes (and /metrics, not in the schema)
                operation["security"] = [{"bearerAuth": []}]
                statuses.append(401)
            if "requestBody" in operation:
                statuses += _GENERATION_ERRORS
                if path in _STREAMED:
                    _streamed(responses)
            elif "{" in path:
                statuses.append(404)
                if path.startswith("/v1/responses/"):  # cancel of a finished one, GET streamed
                    statuses.append(400)
            for status in sorted(statuses):
                responses[str(status)] = _error(status)
    for name in _FASTAPI_VALIDATION:
        schemas.pop(name, None)
    return schema


_STREAMED = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations"})


def _error(status: int) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{ERROR}"}
    return {"description": _WHY[status], "content": {"application/json": {"schema": ref}}}


def _streamed(responses: dict[str, Any]) -> None:
    ok = responses.setdefault("200", {"description": "Successful Response"})
    ok["description"] = "The whole result as JSON, or with `stream: true` server-sent events"
    ok["content"] = {
        "application/json": {"schema": {"type": "object"}},
        "text/event-stream": {
            # one server-sent event: a `data:` line of JSON (or [DONE]), `event:` on Responses
            "schema": {
                "type": "object",
                "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
                "required": ["data"],
            },
            "example": 'data: {"choices": [...]}\n\ndata: [DONE]\n\n',
        },
    }


def _probe(responses: dict[str, Any], why: str) -> None:
    ref = {"$ref": f"#/components/schemas/{PROBE}"}
    content = {"application/json": {"schema": ref}}
    responses["200"] = {"description": why, "content": content}
    responses["503"] = {"description": why, "content": content}
