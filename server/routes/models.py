"""/v1/models and /v1/models/{id}: the model served and its LoRA adapters, OpenAI's cards.

Receives a model id (or none); emits the card, or a 404 naming an unknown model.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from server.errors import APIError
from server.jsonbody import StrictJSONRoute
from server.routes import Served, served

router = APIRouter(route_class=StrictJSONRoute)


def model_card(app: Served) -> dict[str, Any]:
    backend = app.runtime.backend
    config = app.config
    return {
        "id": config.model_name,
        "object": "model",
        "created": app.created,
        "owned_by": "jax-llm-server",
        "root": config.model_name,
        "parent": None,
        "max_model_len": backend.limits.max_model_len if backend else config.max_model_len,
    }


def lora_card(app: Served, name: str) -> dict[str, Any]:
    return app.loras.card(app.loras.modules[name], app.created, model_card(app)["max_model_len"])


@router.get("/v1/models")
async def list_models(app: Annotated[Served, Depends(served)]) -> dict[str, Any]:
    cards = [model_card(app), *(lora_card(app, name) for name in list(app.loras.modules))]
    return {"object": "list", "data": cards}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, app: Annotated[Served, Depends(served)]) -> dict[str, Any]:
    if model_id in app.loras.modules:
        return lora_card(app, model_id)
    if model_id != app.config.model_name:
        raise APIError(
            404,
            f"The model `{model_id}` does not exist.",
            param="model",
            code="model_not_found",
        )
    return model_card(app)
