"""vLLM's tokenizer endpoints: /tokenize, /detokenize and (behind
--enable-tokenizer-info-endpoint, since it shows the chat template) /tokenizer_info.

Receives token requests; emits token ids or text, computed off the event loop.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from server import tokenizing
from server.jsonbody import StrictJSONRoute
from server.lora import select
from server.protocol import DetokenizeRequest, TokenizeRequest
from server.routes import Served, served

router = APIRouter(route_class=StrictJSONRoute)
info_router = APIRouter(route_class=StrictJSONRoute)  # included only when the flag asks for it


@router.post("/tokenize")
async def tokenize(
    body: TokenizeRequest, app: Annotated[Served, Depends(served)]
) -> dict[str, Any]:
    backend = app.runtime.require_ready()
    body, _ = select(app.loras, body)  # an adapter tokenizes as its base model
    return await app.off_loop(
        tokenizing.tokenize, body, backend.tokenizer, app.config.model_name, backend.limits
    )


@router.post("/detokenize")
async def detokenize(
    body: DetokenizeRequest, app: Annotated[Served, Depends(served)]
) -> dict[str, Any]:
    backend = app.runtime.require_ready()
    body, _ = select(app.loras, body)
    return await app.off_loop(tokenizing.detokenize, body, backend.tokenizer, app.config.model_name)


@info_router.get("/tokenizer_info")
async def tokenizer_info(app: Annotated[Served, Depends(served)]) -> dict[str, Any]:
    return app.runtime.require_ready().tokenizer.tokenizer_info()
