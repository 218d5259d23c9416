"""The FastAPI application: routes, middleware, metrics, and the runtime's lifespan.

`create_app(config)` builds a self-contained app (its own registry, its own
runtime); nothing here is global, so tests can run several in one process.
Besides OpenAI's routes it serves vLLM's: /tokenize, /detokenize, /version,
/tokenizer_info (behind --enable-tokenizer-info-endpoint), /v1/chat/completions/batch,
and SageMaker's /ping and /invocations (a chat or a completion body, told apart by
its shape as vLLM does).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry
from prometheus_fastapi_instrumentator import Instrumentator
from pydantic import BaseModel, ValidationError

from server import beam, chat, completions, responses, tokenizing
from server.backend import Backend
from server.config import ServerConfig
from server.errors import APIError, bad_request, install_error_handlers, validation_error
from server.generation import Generation, Shaper, log_of, until_disconnect
from server.jsonbody import StrictJSONRoute
from server.lifecycle import Runtime
from server.lora import LoraRegistry, add_lora_routes, select, with_adapter
from server.metrics import EngineMetrics
from server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestLogMiddleware
from server.openapi import document_api
from server.params import GenerationPlan, plan_completion
from server.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from server.streaming import sse_response
from server.timing import server_timing

T = TypeVar("T")


M = TypeVar("M", bound=BaseModel)


def _parsed(model: type[M], body: Any) -> M:
    """A body read outside FastAPI's parameters, its errors the same 400s."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(RequestValidationError(exc.errors())) from None


def _version() -> str:
    try:
        return importlib.metadata.version("jax-llm-server")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "0.0.0+unknown"


VERSION = _version()
# /invocations reads its body itself (its shape picks the endpoint): documented here
INVOCATION_BODY = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {
                "anyOf": [
                    {"$ref": "#/components/schemas/ChatCompletionRequest"},
                    {"$ref": "#/components/schemas/CompletionRequest"},
                ]
            }
        }
    },
}


def create_app(config: ServerConfig, loader: Callable[[], Backend] | None = None) -> FastAPI:
    """An app serving `config`; `loader` builds the backend (default: `load_backend(config)`)."""
    if loader is None:
        from server.loading import load_backend

        def loader() -> Backend:
            return load_backend(config)

    runtime = Runtime(loader)
    # Tokenizing and chat-template rendering of a large prompt take up to a second of CPU:
    # they run here, never on the event loop, so streams and probes keep their latency.
    text_pool = ThreadPoolExecutor(config.tokenizer_workers, thread_name_prefix="tokenize")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        runtime.start()
        try:
            yield
        finally:
            text_pool.shutdown(wait=False, cancel_futures=True)
        await runtime.shutdown()

    app = FastAPI(title="jax-llm-server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.runtime = runtime
    app.state.config = config
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, config.model_name, runtime.stats)
    app.state.metrics = metrics
    install_error_handlers(app)
    Instrumentator(registry=registry, excluded_handlers=["/metrics"]).instrument(app).expose(
        app, endpoint="/metrics", include_in_schema=False
    )
    _add_routes(app, config, runtime, metrics, text_pool)
    document_api(app, api_key_required=config.api_key is not None)
    # The last added runs first: RequestLog -> ApiKey -> BodyLimit -> routes.
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=config.max_request_bytes,
        read_timeout_s=config.body_read_timeout,
    )
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)  # before the body is read
    app.add_middleware(RequestLogMiddleware)  # outermost: sees every response
    return app


def _add_routes(
    app: FastAPI,
    config: ServerConfig,
    runtime: Runtime,
    metrics: EngineMetrics,
    text_pool: ThreadPoolExecutor,
) -> None:
    created = int(time.time())
    app.router.route_class = StrictJSONRoute  # bodies parse as strict JSON (server.jsonbody)
    loras = LoraRegistry(config.model_name, {m.name: m for m in config.lora_modules})
    if config.enable_runtime_lora_updating:
        add_lora_routes(app, loras, lambda: runtime.require_ready().engine)

    async def off_loop(fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(text_pool, fn, *args)

    @app.get("/health")
    async def health() -> Response:
        if runtime.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "failed"}, status_code=503)

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        """SageMaker's health check: /health's answer."""
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/ready")
    async def ready() -> Response:
        if runtime.ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": runtime.state.value}, status_code=503)

    def model_card() -> dict[str, Any]:
        limits = runtime.backend.limits if runtime.backend else None
        return {
            "id": config.model_name,
            "object": "model",
            "created": created,
            "owned_by": "jax-llm-server",
            "root": config.model_name,
            "parent": None,
            "max_model_len": limits.max_model_len if limits else config.max_model_len,
        }

    def lora_card(name: str) -> dict[str, Any]:
        return loras.card(loras.modules[name], created, model_card()["max_model_len"])

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(), *map(lora_card, list(loras.modules))]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id in loras.modules:
            return lora_card(model_id)
        if model_id != config.model_name:
            raise APIError(
                404,
                f"The model `{model_id}` does not exist.",
                param="model",
                code="model_not_found",
            )
        return model_card()

    async def respond(
        request: Request, backend: Backend, plan: GenerationPlan, shaper: Shaper
    ) -> Response:
        if plan.beam is not None:  # vLLM's beam search: steps of ordinary requests, whole
            work = beam.complete(runtime, backend, plan, metrics, log_of(request), shaper)
            return JSONResponse(await until_disconnect(request, work))
        generation = Generation(runtime, backend, plan, metrics, log_of(request))
        if plan.stream:
            return sse_response(
                generation.stream(shaper),
                ping_interval=config.sse_ping_interval,
                cleanup=generation.close,  # also when the client left before the first byte
            )
        body = await until_disconnect(request, generation.complete(shaper))
        return JSONResponse(body, headers={"Server-Timing": server_timing(generation.timings)})

    async def planned(
        planner: Callable[..., GenerationPlan], body: Any, id_prefix: str
    ) -> tuple[Backend, GenerationPlan, str, str]:
        """The ready backend, the request's plan (made off the event loop), a new id and the
        model the response names (a LoRA adapter's name, server.lora)."""
        backend = runtime.require_ready()
        response_id = f"{id_prefix}{uuid.uuid4().hex}"
        body, model = select(loras, body)
        plan = await off_loop(planner, response_id, body, backend.tokenizer, config, backend.limits)
        return backend, with_adapter(plan, model, loras), response_id, model

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        backend, plan, response_id, model = await planned(plan_completion, body, "cmpl-")
        shaper = completions.CompletionShaper(plan, backend.tokenizer, model, response_id)
        return await respond(request, backend, plan, shaper)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        backend, plan, response_id, model = await planned(chat.plan_chat, body, "chatcmpl-")
        shaper = chat.ChatShaper(plan, backend.tokenizer, model, response_id)
        return await respond(request, backend, plan, shaper)

    @app.post("/v1/chat/completions/batch")
    async def create_batch_chat_completion(
        body: BatchChatCompletionRequest, request: Request
    ) -> Response:
        backend, plan, response_id, model = await planned(chat.plan_batch_chat, body, "chatcmpl-")
        shaper = chat.ChatShaper(plan, backend.tokenizer, model, response_id)
        return await respond(request, backend, plan, shaper)

    @app.post("/invocations", openapi_extra={"requestBody": INVOCATION_BODY})
    async def invocations(request: Request) -> Response:
        """SageMaker's entry point: a body with `messages` is a chat completion, one with
        `prompt` a completion (vLLM tries the chat request first, then the completion)."""
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            message = f"request body is not valid JSON: {exc.msg}"
            raise bad_request(message, code="invalid_json") from None
        if isinstance(body, dict) and "messages" in body:
            return await create_chat_completion(_parsed(ChatCompletionRequest, body), request)
        if isinstance(body, dict) and "prompt" in body:
            return await create_completion(_parsed(CompletionRequest, body), request)
        raise bad_request(
            "Cannot find suitable handler for request. Expected one of: "
            "ChatCompletionRequest (messages), CompletionRequest (prompt)"
        )

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        backend, plan, response_id, model = await planned(responses.plan_response, body, "resp_")
        shaper = responses.ResponsesShaper(plan, body, model, response_id)
        if not plan.stream:
            return await respond(request, backend, plan, shaper)
        generation = Generation(runtime, backend, plan, metrics, log_of(request))
        return sse_response(  # named events: its own framing, the same Generation
            responses.stream_events(generation, shaper),
            ping_interval=config.sse_ping_interval,
            cleanup=generation.close,
        )

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        backend = runtime.require_ready()
        body, _ = select(loras, body)  # an adapter tokenizes as its base model
        return await off_loop(
            tokenizing.tokenize, body, backend.tokenizer, config.model_name, backend.limits
        )

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        backend = runtime.require_ready()
        body, _ = select(loras, body)
        return await off_loop(tokenizing.detokenize, body, backend.tokenizer, config.model_name)

    if config.enable_tokenizer_info_endpoint:  # off by default: it shows the chat template

        @app.get("/tokenizer_info")
        async def tokenizer_info() -> dict[str, Any]:
            return runtime.require_ready().tokenizer.tokenizer_info()
