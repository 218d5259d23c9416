"""Probes: /health and SageMaker's /ping (loaded and alive), /ready (readiness), /version.

Receives nothing but the request; emits `{"status": ...}` with 200 or 503, as the
runtime (server.lifecycle, the one owner of the serving state) answers.
"""

from __future__ import annotations

import importlib.metadata
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from server.jsonbody import StrictJSONRoute
from server.lifecycle import State
from server.routes import Served, served

router = APIRouter(route_class=StrictJSONRoute)


def _version() -> str:
    try:
        return importlib.metadata.version("jax-llm-server")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "0.0.0+unknown"


VERSION = _version()


@router.get("/health")
async def health(app: Annotated[Served, Depends(served)]) -> Response:
    """200 once the model is loaded and while its engine lives (draining too); 503 while
    it loads, as a vLLM server answers nothing until its engine is up, so a client that
    waits for /health may send requests at once; 503 for good once the engine failed."""
    runtime = app.runtime
    if not runtime.alive:
        return JSONResponse({"status": "failed"}, status_code=503)
    if runtime.state is State.LOADING:
        return JSONResponse({"status": "loading"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ping")
@router.post("/ping")
async def ping(app: Annotated[Served, Depends(served)]) -> Response:
    """SageMaker's health check: /health's answer."""
    return await health(app)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": VERSION}


@router.get("/ready")
async def ready(app: Annotated[Served, Depends(served)]) -> Response:
    if app.runtime.ready:
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": app.runtime.state.value}, status_code=503)
