"""The FastAPI application: the routers, middleware, metrics, and the runtime's lifespan.

`create_app(config)` builds a self-contained app (its own registry, its own runtime,
its own `Served` on app.state); nothing here is global, so tests can run several in one
process. The routes live in server/routes/, one router per endpoint family: probes,
models, generate (OpenAI's completions, chat and responses, vLLM's batch chat,
SageMaker's /invocations), tokens (vLLM's /tokenize, /detokenize, /tokenizer_info).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from prometheus_fastapi_instrumentator import Instrumentator

from server.backend import Backend
from server.config import ServerConfig
from server.errors import install_error_handlers
from server.lifecycle import Runtime
from server.lora import LoraRegistry, add_lora_routes
from server.metrics import EngineMetrics
from server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestLogMiddleware
from server.openapi import document_api
from server.response_store import ResponseStore
from server.routes import Served, generate, models, probes, tokens


def create_app(config: ServerConfig, loader: Callable[[], Backend] | None = None) -> FastAPI:
    """An app serving `config`; `loader` builds the backend (default: `load_backend(config)`)."""
    if loader is None:
        from server.loading import load_backend

        def loader() -> Backend:
            return load_backend(config)

    runtime = Runtime(loader)
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
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, config.model_name, runtime.stats)
    app.state.runtime = runtime  # the probes and the entrypoint's drain read it
    loras = LoraRegistry(config.model_name, {m.name: m for m in config.lora_modules})
    app.state.served = Served(
        config,
        runtime,
        metrics,
        text_pool,
        created=int(time.time()),
        loras=loras,
        responses=ResponseStore(config.responses_store_size),
    )
    if config.enable_runtime_lora_updating:
        add_lora_routes(app, loras, lambda: runtime.require_ready().engine)
    install_error_handlers(app)
    Instrumentator(registry=registry, excluded_handlers=["/metrics"]).instrument(app).expose(
        app, endpoint="/metrics", include_in_schema=False
    )
    for router in (probes.router, models.router, generate.router, tokens.router):
        app.include_router(router)
    if config.enable_tokenizer_info_endpoint:  # off by default: it shows the chat template
        app.include_router(tokens.info_router)
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
