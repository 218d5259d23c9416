"""LoRA adapters at the HTTP edge: vLLM's flags, the adapters a request may name, and
vLLM's run-time routes to load and unload them.

Runs on: the event loop (routes, `select`) and the planner threads (reads of the
registry). Owns: `LoraModule` (one `--lora-modules` entry), the registry of adapter
names this server serves (the start-time ones, then the run-time loads and unloads that
the core confirmed) and the routes POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (behind --enable-runtime-lora-updating: they read server-side
paths). Receives requests' `model`; emits the adapter a generation runs with (the
engine core reads, checks and applies it: engine.lora), model cards, and 4xx errors.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from frontend.lora_requests import LoraRequests
from server.errors import APIError, bad_request

if TYPE_CHECKING:  # server.params reads server.config, which reads this module
    from server.params import GenerationPlan

LOAD_TIMEOUT_S = 600.0  # a load reads the adapter's files on the core's host


@dataclass(frozen=True)
class LoraModule:
    """An adapter served as `name` (vLLM's --lora-modules entry)."""

    name: str
    path: str
    base_model_name: str | None = None  # its `parent` in /v1/models (default: the base's)


def parse_lora_modules(values: str | Sequence[str]) -> tuple[LoraModule, ...]:
    """vLLM's forms: `name=path`, or JSON {"name", "path", "base_model_name"}; the flag
    takes several, and so does its variable (a JSON list of either, or `name=path` entries
    separated by spaces, as one flag value may have them too)."""
    if isinstance(values, str):
        text = values.strip()
        values = [str(v) for v in json.loads(text)] if text.startswith("[") else [text]
    entries: list[str] = []
    for value in values:
        value = value.strip()
        entries += [value] if value.startswith("{") else value.split()
    out = []
    for value in entries:
        if value.startswith("{"):
            try:
                raw = json.loads(value)
                module = LoraModule(raw["name"], raw["path"], raw.get("base_model_name"))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f'a LoRA module as JSON needs "name" and "path", got {value!r}'
                ) from exc
        else:
            name, sep, path = value.partition("=")
            if not sep:
                raise ValueError(f"a LoRA module is name=path or JSON, got {value!r}")
            module = LoraModule(name.strip(), path.strip())
        if not module.name or not module.path:
            raise ValueError(f"a LoRA module needs a name and a path, got {value!r}")
        out.append(module)
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        raise ValueError(f"LoRA module names repeat: {names}")
    return tuple(out)


@runtime_checkable
class LoraEngine(Protocol):
    """An engine that loads adapters at run time (frontend.client.EngineClient)."""

    loras: LoraRequests


@dataclass
class LoraRegistry:
    """The adapters a request may name now (the engine core has each one loaded)."""

    base: str  # the served model's name
    modules: dict[str, LoraModule] = field(default_factory=dict)

    def card(self, module: LoraModule, created: int, max_model_len: int) -> dict[str, Any]:
        return {
            "id": module.name,
            "object": "model",
            "created": created,
            "owned_by": "jax-llm-server",
            "root": module.path,
            "parent": module.base_model_name or self.base,
            "max_model_len": max_model_len,
        }

    def find(self, model: str | None) -> LoraModule | None:
        """The adapter `model` names; None for the base model (or no model given)."""
        if model is None or model == self.base:
            return None
        module = self.modules.get(model)
        if module is None:
            raise APIError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )
        return module


B = TypeVar("B")


def select(registry: LoraRegistry, body: B) -> tuple[B, str]:
    """The body as the base model's planners check it, and the model name its response
    carries: an adapter's name is the base's for planning, its own in the reply."""
    module = registry.find(getattr(body, "model", None))
    if module is None:
        return body, registry.base
    if getattr(body, "use_beam_search", False):
        raise bad_request("use_beam_search is not supported with a LoRA adapter", "model")
    return body.model_copy(update={"model": registry.base}), module.name  # type: ignore[attr-defined]


def with_adapter(plan: GenerationPlan, model: str, registry: LoraRegistry) -> GenerationPlan:
    """The plan's engine requests run with the adapter `model` names (the base: as is)."""
    if model == registry.base:
        return plan
    return replace(plan, requests=tuple(replace(r, lora=model) for r in plan.requests))


def add_lora_routes(app: FastAPI, registry: LoraRegistry, engine_of: Any) -> None:
    """vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter; `engine_of()` is the
    ready backend's engine (a 503 while none is)."""

    async def answer(ask: Any, *args: str) -> str | None:
        engine = engine_of()
        if not isinstance(engine, LoraEngine):
            raise bad_request("this engine does not load LoRA adapters at run time")
        future = ask(engine.loras, *args)
        return await asyncio.wait_for(asyncio.wrap_future(future), LOAD_TIMEOUT_S)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = await _object(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        if name in registry.modules or name == registry.base:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        error = await answer(LoraRequests.load, name, path)
        if error is not None:
            raise bad_request(error, "lora_path", code="invalid_lora_adapter")
        registry.modules[name] = LoraModule(name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = await _object(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.")
        if name not in registry.modules:
            raise APIError(
                404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                code="lora_not_found",
            )  # fmt: skip
        del registry.modules[name]  # new requests no longer find it; running ones finish
        error = await answer(LoraRequests.unload, name)
        if error is not None:
            raise bad_request(error, "lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _object(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body
