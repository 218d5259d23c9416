"""The generation endpoints: /v1/completions, /v1/chat/completions (and vLLM's /batch),
/v1/responses (and GET, cancel and DELETE of a stored response: server.response_store),
and SageMaker's /invocations (a chat or a completion body, told apart by its shape as
vLLM does).

Receives a validated request body; plans it off the event loop (server.params,
server.chat, server.responses), runs it as one Generation (or a beam search) and emits
one JSON body or a server-sent event stream.
"""

from __future__ import annotations

import asyncio
import functools
import json
import uuid
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from server import beam, chat, completions, responses
from server.backend import Backend
from server.errors import bad_request, validation_error
from server.generation import Generation, RequestLog, Shaper, log_of, until_disconnect
from server.jsonbody import StrictJSONRoute
from server.lora import select, with_adapter
from server.params import GenerationPlan, plan_completion
from server.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesInputItem,
    ResponsesRequest,
)
from server.response_store import StoredResponse
from server.routes import Served, served
from server.streaming import sse_response
from server.timing import server_timing

router = APIRouter(route_class=StrictJSONRoute)
App = Annotated[Served, Depends(served)]
M = TypeVar("M", bound=BaseModel)

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


async def planned(
    app: Served, planner: Callable[..., GenerationPlan], body: Any, id_prefix: str
) -> tuple[Backend, GenerationPlan, str, str]:
    """The ready backend, the request's plan (made off the event loop), a new id and the
    model the response names (a LoRA adapter's name, server.lora)."""
    backend = app.runtime.require_ready()
    response_id = f"{id_prefix}{uuid.uuid4().hex}"
    body, model = select(app.loras, body)
    plan = await app.off_loop(
        planner, response_id, body, backend.tokenizer, app.config, backend.limits
    )
    return backend, with_adapter(plan, model, app.loras), response_id, model


async def respond(
    app: Served, request: Request, backend: Backend, plan: GenerationPlan, shaper: Shaper
) -> Response:
    """Run a plan: a beam search (whole), a stream of events, or one JSON body."""
    if plan.beam is not None:  # vLLM's beam search: steps of ordinary requests, whole
        work = beam.complete(app.runtime, backend, plan, app.metrics, log_of(request), shaper)
        return JSONResponse(await until_disconnect(request, work))
    generation = Generation(app.runtime, backend, plan, app.metrics, log_of(request))
    if plan.stream:
        return sse_response(
            generation.stream(shaper),
            ping_interval=app.config.sse_ping_interval,
            cleanup=generation.close,  # also when the client left before the first byte
        )
    body = await until_disconnect(request, generation.complete(shaper))
    return JSONResponse(body, headers={"Server-Timing": server_timing(generation.timings)})


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, app: App) -> Response:
    backend, plan, response_id, model = await planned(app, plan_completion, body, "cmpl-")
    shaper = completions.CompletionShaper(plan, backend.tokenizer, model, response_id)
    return await respond(app, request, backend, plan, shaper)


@router.post("/v1/chat/completions")
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, app: App
) -> Response:
    backend, plan, response_id, model = await planned(app, chat.plan_chat, body, "chatcmpl-")
    shaper = chat.ChatShaper(plan, backend.tokenizer, model, response_id)
    return await respond(app, request, backend, plan, shaper)


@router.post("/v1/chat/completions/batch")
async def create_batch_chat_completion(
    body: BatchChatCompletionRequest, request: Request, app: App
) -> Response:
    backend, plan, response_id, model = await planned(app, chat.plan_batch_chat, body, "chatcmpl-")
    shaper = chat.ChatShaper(plan, backend.tokenizer, model, response_id)
    return await respond(app, request, backend, plan, shaper)


@router.post("/invocations", openapi_extra={"requestBody": INVOCATION_BODY})
async def invocations(request: Request, app: App) -> Response:
    """SageMaker's entry point: a body with `messages` is a chat completion, one with
    `prompt` a completion (vLLM tries the chat request first, then the completion)."""
    try:
        body = await request.json()
    except json.JSONDecodeError as exc:
        message = f"request body is not valid JSON: {exc.msg}"
        raise bad_request(message, code="invalid_json") from None
    if isinstance(body, dict) and "messages" in body:
        return await create_chat_completion(_parsed(ChatCompletionRequest, body), request, app)
    if isinstance(body, dict) and "prompt" in body:
        return await create_completion(_parsed(CompletionRequest, body), request, app)
    raise bad_request(
        "Cannot find suitable handler for request. Expected one of: "
        "ChatCompletionRequest (messages), CompletionRequest (prompt)"
    )


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, app: App) -> Response:
    store = app.responses
    stored = body.store and store.enabled
    if body.background and not store.enabled:
        raise bad_request(
            "background needs the response store: this server keeps no responses "
            "(--responses-store-size 0)",
            param="background",
        )
    history: tuple[ResponsesInputItem, ...] = ()
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id, param="previous_response_id")
        history = tuple(ResponsesInputItem.model_validate(i) for i in previous.conversation)
    planner = functools.partial(responses.plan_response, history=history)
    backend, plan, response_id, model = await planned(app, planner, body, "resp_")
    prompt_text = None
    if body.enable_response_messages:
        decode = functools.partial(backend.tokenizer.decode, skip_special_tokens=False)
        prompt_text = await app.off_loop(decode, plan.prompts[0].ids)
    shaper = responses.ResponsesShaper(
        plan,
        body,
        model,
        response_id,
        backend.tokenizer,
        stored=stored,
        history=history,
        prompt_text=prompt_text,
    )

    def keep(response: dict[str, Any]) -> None:
        """A finished response into the store (a failed one is not kept)."""
        store.put(response_id, StoredResponse(response, shaper.conversation()))

    def progress(response: dict[str, Any]) -> None:
        """A background response's new state; its conversation once it has ended."""
        ended = response["status"] in ("completed", "incomplete")
        store.update(response_id, response, shaper.conversation() if ended else None)

    if body.background:  # runs past this request: its own log record, the store's task
        generation = Generation(app.runtime, backend, plan, app.metrics, RequestLog())
        queued = shaper.response_object(None, status="queued")
        run = responses.run_in_background(generation, shaper, progress)
        store.put(response_id, StoredResponse(queued, (), True, asyncio.create_task(run)))
        return JSONResponse(queued)
    generation = Generation(app.runtime, backend, plan, app.metrics, log_of(request))
    if plan.stream:
        return sse_response(  # named events: its own framing, the same Generation
            responses.stream_events(generation, shaper, keep if stored else None),
            ping_interval=app.config.sse_ping_interval,
            cleanup=generation.close,
        )
    whole = await until_disconnect(request, generation.complete(shaper))
    if stored:
        keep(whole)
    return JSONResponse(whole, headers={"Server-Timing": server_timing(generation.timings)})


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, app: App, stream: bool = False) -> Response:
    """A stored response as it stands (a background one: queued, in progress, then done)."""
    if stream:
        raise bad_request("stream is not supported when retrieving a response", param="stream")
    return JSONResponse(app.responses.get(response_id).body)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, app: App) -> Response:
    """Cancel a background response still running (vLLM's and OpenAI's)."""
    return JSONResponse(await app.responses.cancel(response_id))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, app: App) -> Response:
    return JSONResponse(await app.responses.delete(response_id))


def _parsed(model: type[M], body: Any) -> M:
    """A body read outside FastAPI's parameters, its errors the same 400s."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(RequestValidationError(exc.errors())) from None
