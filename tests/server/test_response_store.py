"""Stored Responses through the openai SDK: retrieve, continue, background, cancel, delete.

On the tiny real model a continued response (`previous_response_id`) must say what a
chat completion of the whole conversation says at temperature 0, and a background
response what the same request says in the foreground. A scripted orchestrator holds a
request open, which the random model cannot be made to do on demand, so a cancellation
can be seen to abort it; and a store of two shows what is dropped first.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from server.response_store import ResponseStore, StoredResponse
from tests.server.harness import MODEL_NAME, LiveServer, make_config, serve_in_thread
from tests.server.scripted import ScriptedEngine, delta, scripted_backend

FIRST = "My name is Mark."
SECOND = "What is my name?"


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return sdk(live.base_url)


def until_done(client: openai.OpenAI, response_id: str) -> openai.types.responses.Response:
    """Poll a background response while it is "queued" (60 s at most), as vLLM's own test
    polls it: vLLM keeps a running response "queued" until it ends, and so does this server."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        response = client.responses.retrieve(response_id)
        if response.status != "queued":
            return response
        time.sleep(0.05)
    raise AssertionError(f"{response_id} still {response.status}")


# ---- the real model ----------------------------------------------------------------------


def test_a_stored_response_is_retrieved_as_it_was_returned(client: openai.OpenAI) -> None:
    made = client.responses.create(input=FIRST, max_output_tokens=5, temperature=0)
    assert made.store is True  # OpenAI's default
    again = client.responses.retrieve(made.id)
    assert again.model_dump() == made.model_dump()
    streamed = list(client.responses.create(input=FIRST, max_output_tokens=5, stream=True))
    final = streamed[-1].response
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    made = client.responses.create(input=FIRST, max_output_tokens=2, store=False)
    assert made.store is False
    with pytest.raises(openai.NotFoundError, match=f"Response with id '{made.id}' not found."):
        client.responses.retrieve(made.id)


def test_a_continued_response_reads_the_whole_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(
        instructions="Be brief.", input=FIRST, max_output_tokens=6, temperature=0
    )
    second = client.responses.create(
        previous_response_id=first.id, input=SECOND, max_output_tokens=6, temperature=0
    )
    # instructions are not carried to the next turn (OpenAI's rule)
    messages = [
        {"role": "user", "content": FIRST},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": SECOND},
    ]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    third = client.responses.create(
        previous_response_id=second.id, input="Again?", max_output_tokens=2, temperature=0
    )
    longer = messages + [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Again?"},
    ]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=longer, max_tokens=2, temperature=0
    )
    assert third.usage.input_tokens == chat.usage.prompt_tokens
    with pytest.raises(openai.NotFoundError, match="resp_nope") as missing:
        client.responses.create(previous_response_id="resp_nope", input=SECOND)
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_a_background_response_says_what_the_foreground_says(client: openai.OpenAI) -> None:
    kwargs = {"input": FIRST, "max_output_tokens": 8, "temperature": 0}
    queued = client.responses.create(background=True, **kwargs)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = until_done(client, queued.id)
    plain = client.responses.create(**kwargs)
    assert done.status == plain.status and done.output_text == plain.output_text
    assert done.usage.output_tokens == plain.usage.output_tokens
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a response whose status"):
        client.responses.cancel(queued.id)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response."):
        client.responses.cancel(plain.id)


def test_background_needs_the_store(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="`store` is true"):
        client.responses.create(input=FIRST, background=True, store=False)


def test_a_deleted_response_is_gone(client: openai.OpenAI, live: LiveServer) -> None:
    made = client.responses.create(input=FIRST, max_output_tokens=2)
    out = httpx.delete(f"{live.v1}/responses/{made.id}", timeout=30)
    assert out.json() == {"id": made.id, "object": "response", "deleted": True}
    for call in (client.responses.retrieve, client.responses.cancel, client.responses.delete):
        with pytest.raises(openai.NotFoundError, match="not found"):
            call(made.id)


# ---- a scripted orchestrator ---------------------------------------------------------------


@pytest.fixture(scope="module")
def scripted(tiny_checkpoint: Path) -> Iterator[tuple[LiveServer, ScriptedEngine]]:
    orchestrator = ScriptedEngine()
    backend, _ = scripted_backend(tiny_checkpoint, orchestrator, max_model_len=1024)
    config = make_config(tiny_checkpoint, responses_store_size=2)
    with serve_in_thread(config, loader=lambda: backend) as server:
        yield server, orchestrator


def test_cancelling_a_background_response_aborts_its_request(scripted) -> None:
    server, orchestrator = scripted
    client = sdk(server.base_url)
    orchestrator.script, orchestrator.hold = [delta("Once", 1)], True
    try:
        started = len(orchestrator.submitted)
        queued = client.responses.create(input=FIRST, background=True)
        deadline = time.monotonic() + 30
        while len(orchestrator.submitted) == started:  # its request reaches the engine
            assert time.monotonic() < deadline, "never started"
            time.sleep(0.02)
        assert client.responses.retrieve(queued.id).status == "queued"  # vLLM's word, running
        cancelled = client.responses.cancel(queued.id)
    finally:
        orchestrator.hold = False
    assert cancelled.status == "cancelled"
    assert orchestrator.aborted[-1] == orchestrator.submitted[-1].request_id
    assert client.responses.retrieve(queued.id).status == "cancelled"  # it stays so


def test_a_failed_background_response_says_why(scripted) -> None:
    from frontend.request import RequestFailed

    server, orchestrator = scripted
    client = sdk(server.base_url)
    orchestrator.script, orchestrator.failure = [delta("Hel", 1)], RequestFailed("boom")
    try:
        queued = client.responses.create(input=FIRST, background=True)
        failed = until_done(client, queued.id)
    finally:
        orchestrator.failure = None
    assert failed.status == "failed"
    assert failed.error is not None and "boom" in failed.error.message


def test_the_store_drops_the_oldest_past_its_size(scripted) -> None:
    server, orchestrator = scripted
    client = sdk(server.base_url)
    orchestrator.script = [delta("ok", 1, "stop")]
    ids = [client.responses.create(input=FIRST).id for _ in range(3)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).output_text for i in ids[1:]] == ["ok", "ok"]


def test_a_running_response_is_not_dropped() -> None:
    store = ResponseStore(1)
    store.put("a", StoredResponse({"status": "in_progress"}, (), background=True))
    store.put("b", StoredResponse({"status": "completed"}, ()))
    store.put("c", StoredResponse({"status": "completed"}, ()))
    with pytest.raises(Exception, match="not found"):
        store.get("b")
    assert store.get("a").running and len(store) == 2
    store.update("a", {"status": "completed"}, ({"type": "message"},))
    store.put("d", StoredResponse({"status": "completed"}, ()))
    assert len(store) == 1 and store.get("d")


def test_no_store_means_store_is_ignored_and_background_refused(tiny_checkpoint: Path) -> None:
    orchestrator = ScriptedEngine(script=[delta("ok", 1, "stop")])
    backend, _ = scripted_backend(tiny_checkpoint, orchestrator)
    config = make_config(tiny_checkpoint, responses_store_size=0)
    with serve_in_thread(config, loader=lambda: backend) as server:
        client = sdk(server.base_url)
        made = client.responses.create(input=FIRST)
        assert made.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made.id)
        with pytest.raises(openai.BadRequestError, match="keeps no responses"):
            client.responses.create(input=FIRST, background=True)
