"""POST /v1/responses through the official openai SDK: what Responses API users see.

On the tiny real model a response must say exactly what a chat completion of the
same conversation says at temperature 0, whole or streamed. A scripted orchestrator
gives the endings the random model cannot be made to give on demand: a natural stop
and a failure after the stream has started.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine.request import RequestFailed
from tests.server.harness import MODEL_NAME, LiveServer, make_config, serve_in_thread
from tests.server.scripted import ScriptedOrchestrator, delta, scripted_backend
from tokenization import Tokenizer

INSTRUCTIONS = "Be brief."
QUESTION = "Tell me a story"
EVENTS_BEFORE = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
EVENTS_AFTER = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return sdk(live.base_url)


def named_events(raw: str) -> list[tuple[str, dict]]:
    """(event name, data) of each event, checking the `event:` + `data:` framing."""
    assert "\r" not in raw and raw.endswith("\n\n")
    out = []
    for block in raw.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        assert len(lines) == 2 and lines[0].startswith("event: "), block
        assert lines[1].startswith("data: "), block
        data = json.loads(lines[1][len("data: ") :])
        assert data["type"] == lines[0][len("event: ") :]
        out.append((data["type"], data))
    assert [d["sequence_number"] for _, d in out] == list(range(len(out)))
    return out


# ---- the real model ----------------------------------------------------------------------


def test_a_response_says_what_chat_says(client: openai.OpenAI) -> None:
    whole = client.responses.create(
        model=MODEL_NAME,
        instructions=INSTRUCTIONS,
        input=QUESTION,
        max_output_tokens=6,
        temperature=0,
    )
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=6,
        temperature=0,
    )
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.model == MODEL_NAME and whole.instructions == INSTRUCTIONS
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.usage.total_tokens == chat.usage.total_tokens
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert [(c.type, c.annotations) for c in message.content] == [("output_text", [])]
    if chat.choices[0].finish_reason == "length":
        assert whole.status == message.status == "incomplete"
        assert whole.incomplete_details.reason == "max_output_tokens"
    else:
        assert whole.status == message.status == "completed"
        assert whole.incomplete_details is None


def test_a_stream_says_what_the_whole_says(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL_NAME, "input": QUESTION, "max_output_tokens": 8, "temperature": 0}
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    deltas = types[len(EVENTS_BEFORE) : -len(EVENTS_AFTER)]
    assert types == EVENTS_BEFORE + deltas + EVENTS_AFTER
    assert deltas and set(deltas) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == final.output_text
    assert events[-4].text == text and events[-3].part.text == text
    assert final.usage == whole.usage and final.status == whole.status
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"


def test_raw_events_are_named_and_numbered(live: LiveServer) -> None:
    body = {"input": QUESTION, "max_output_tokens": 4, "temperature": 0, "stream": True}
    out = httpx.post(live.v1 + "/responses", json=body, timeout=60)
    assert out.status_code == 200
    assert out.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in out.text
    events = named_events(out.text)
    assert [t for t, _ in events[:4]] == EVENTS_BEFORE
    assert [t for t, _ in events[-4:]] == EVENTS_AFTER
    completed = events[-1][1]["response"]
    assert completed["usage"]["output_tokens"] == 4
    assert completed["status"] == "incomplete"  # four tokens at most: the budget ran out
    assert completed["incomplete_details"] == {"reason": "max_output_tokens"}


def test_create_stream_yields_typed_events(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=3, stream=True)
    )
    assert events[0].type == "response.created"
    assert isinstance(events[-1], openai.types.responses.ResponseCompletedEvent)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text


def test_message_items_render_like_chat_messages(client: openai.OpenAI) -> None:
    two_parts = [{"type": "input_text", "text": "One"}, {"type": "input_text", "text": "two"}]
    items = [
        {"role": "user", "content": two_parts},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "3"}]},
        {"type": "message", "role": "developer", "content": "Four"},
    ]
    messages = [
        {"role": "user", "content": "One\ntwo"},
        {"role": "assistant", "content": "3"},
        {"role": "developer", "content": "Four"},
    ]
    whole = client.responses.create(
        model=MODEL_NAME, input=items, max_output_tokens=5, temperature=0, store=False
    )
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=5, temperature=0
    )
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.output_text == chat.choices[0].message.content


# ---- a scripted orchestrator ---------------------------------------------------------------


@pytest.fixture(scope="module")
def scripted(tiny_checkpoint: Path) -> Iterator[tuple[LiveServer, ScriptedOrchestrator, Tokenizer]]:
    orchestrator = ScriptedOrchestrator()
    backend, tokenizer = scripted_backend(tiny_checkpoint, orchestrator)
    with serve_in_thread(make_config(tiny_checkpoint), loader=lambda: backend) as server:
        yield server, orchestrator, tokenizer


def test_the_plan_reaches_the_engine(scripted) -> None:
    server, orchestrator, tokenizer = scripted
    orchestrator.script, orchestrator.failure = [delta("Hel", 1), delta("lo", 2, "stop")], None
    whole = sdk(server.base_url).responses.create(
        input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=9, temperature=0.5, top_p=0.75
    )
    request = orchestrator.submitted[-1]
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    assert request.prompt_ids == tuple(tokenizer.apply_chat_template(messages))
    assert request.max_tokens == 9 and request.n == 1
    assert (request.sampling.temperature, request.sampling.top_p) == (0.5, 0.75)
    assert whole.status == "completed" and whole.incomplete_details is None
    assert whole.output_text == "Hello" and whole.output[0].status == "completed"
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (len(request.prompt_ids), 2)
    assert whole.temperature == 0.5 and whole.top_p == 0.75 and whole.max_output_tokens == 9


def test_a_failure_mid_stream_is_an_error_event(scripted) -> None:
    server, orchestrator, _ = scripted
    orchestrator.script, orchestrator.failure = [delta("Hel", 1)], RequestFailed("boom")
    body = {"input": QUESTION, "stream": True}
    raw = httpx.post(server.v1 + "/responses", json=body, timeout=60).text
    events = named_events(raw)
    assert [t for t, _ in events] == [*EVENTS_BEFORE, "response.output_text.delta", "error"]
    error = events[-1][1]
    assert error["message"] == "request failed: boom" and error["code"] == "engine_failure"
    assert error["error"]["message"] == error["message"]
    with pytest.raises(openai.APIError, match="boom"):  # the SDK raises at the error event
        list(sdk(server.base_url).responses.create(input=QUESTION, stream=True))
    with pytest.raises(openai.APIStatusError, match="boom") as whole:
        sdk(server.base_url).responses.create(input=QUESTION)
    assert whole.value.status_code == 503


IMAGE = [{"type": "input_image", "image_url": "data:,"}]
CASES = [
    ("tools", {"tools": [{"type": "function", "name": "f", "parameters": {}}]}, 400, "tools",
     "tools are not supported yet on /v1/responses"),
    ("store true", {"store": True}, 400, "store", "no state is kept"),
    ("previous_response_id", {"previous_response_id": "resp_1"}, 400, "previous_response_id",
     "no state is kept"),
    ("unknown model", {"model": "gpt-9"}, 404, "model", "gpt-9"),
    ("image part", {"input": [{"role": "user", "content": IMAGE}]}, 400, "input", "text-only"),
    ("function call output", {"input": [{"type": "function_call_output", "output": "x"}]}, 400,
     "input", "function_call_output"),
    ("empty input list", {"input": []}, 400, "input", "empty"),
    ("input missing", {"input": None}, 400, "input", None),
    ("bad role", {"input": [{"role": "wizard", "content": "x"}]}, 400, "input", "wizard"),
    ("zero max_output_tokens", {"max_output_tokens": 0}, 400, "max_output_tokens", None),
    ("temperature above 2", {"temperature": 3}, 400, "temperature", None),
    ("structured output", {"text": {"format": {"type": "json_schema", "schema": {}}}}, 400,
     "text", "structured"),
    ("background", {"background": True}, 400, "background", None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "status", "param", "says"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_what_is_not_served_is_a_clear_error(
    scripted, body: dict, status: int, param: str, says: str | None
) -> None:
    server = scripted[0]
    out = httpx.post(server.v1 + "/responses", json={"input": "x", **body}, timeout=60)
    assert out.status_code == status, out.text
    error = out.json()["error"]
    assert error["param"] == param
    assert says is None or says in error["message"]


def test_store_false_and_no_tools_are_served(scripted) -> None:
    server, orchestrator, _ = scripted
    orchestrator.script, orchestrator.failure = [delta("ok", 1, "stop")], None
    out = sdk(server.base_url).responses.create(
        input="x", store=False, tools=[], tool_choice="auto", previous_response_id=None
    )
    assert out.output_text == "ok" and out.store is False and out.tools == []
