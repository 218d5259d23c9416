"""vLLM's request extensions through the real server and the official openai client (issue
28, items 3, 4, 6 and 7): each works as vLLM documents it, or is a 400 that names it.

prompt_logprobs, return_token_ids, return_tokens_as_token_ids, continuous usage stats,
truncate_prompt_tokens, stop_reason, usage's cached_tokens; the fields served nowhere
here (kv_transfer_params); unknown fields logged;
tool_choice's constraint over response_format's; every bad value named.
"""

from __future__ import annotations

import json
import logging
import uuid

import httpx
import jsonschema
import openai
import pytest

from engine.types import MAX_LOGPROBS
from tests.server.harness import MODEL_NAME, LiveServer, pick_stop

PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=120)


def tokenize(live: LiveServer, prompt: str) -> list[int]:
    response = httpx.post(live.base_url + "/tokenize", json={"prompt": prompt}, timeout=30)
    return list(response.json()["tokens"])


def vocab_size(live: LiveServer) -> int:
    return int(live.app.state.runtime.backend.limits.vocab_size)  # type: ignore[attr-defined]


def bad_request(call: object) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()  # type: ignore[operator]
    return info.value


def error_of(error: openai.BadRequestError) -> dict:
    return error.body if isinstance(error.body, dict) else {}  # type: ignore[return-value]


# --- prompt_logprobs ------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 2])
def test_prompt_logprobs_on_completions(client: openai.OpenAI, live: LiveServer, k: int) -> None:
    ids = tokenize(live, PROMPT)
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": k}
    )
    entries = out.choices[0].prompt_logprobs  # type: ignore[attr-defined]
    assert len(entries) == len(ids) and entries[0] is None
    for token_id, position in zip(ids[1:], entries[1:], strict=True):
        assert str(token_id) in position  # the prompt token, and the top k beside it
        assert k <= len(position) <= k + 1
        for entry in position.values():
            assert entry["logprob"] <= 0 and isinstance(entry["decoded_token"], str)
        ranked = sorted((e for e in position.values() if e["rank"] is not None),
                        key=lambda e: e["rank"])  # fmt: skip
        assert [e["rank"] for e in ranked] == list(range(1, len(ranked) + 1))
    assert out.choices[0].logprobs is None  # prompt logprobs are not the output's


def test_echo_with_logprobs_gives_prompt_logprobs_too(client: openai.OpenAI) -> None:
    """vLLM's: echo with logprobs asks for the prompt's logprobs with as many alternatives."""
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1
    )
    entries = out.choices[0].prompt_logprobs  # type: ignore[attr-defined]
    assert entries[0] is None and all(1 <= len(p) <= 2 for p in entries[1:])


def test_echo_of_token_ids_shows_special_tokens(client: openai.OpenAI, live: LiveServer) -> None:
    """vLLM echoes a token-id prompt as its ids decoded, BOS and all; offsets follow."""
    ids = tokenize(live, PROMPT)  # starts with BOS, a special token
    out = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True, logprobs=0
    )
    choice = out.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and len(logprobs.tokens) == len(ids)
    assert choice.text.startswith(logprobs.tokens[0]) and logprobs.text_offset[0] == 0
    for token, offset in zip(logprobs.tokens, logprobs.text_offset, strict=True):
        assert choice.text[offset:].startswith(token), (token, offset, choice.text)


def test_prompt_logprobs_on_chat(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    entries = out.prompt_logprobs  # type: ignore[attr-defined]
    assert len(entries) == out.usage.prompt_tokens and entries[0] is None
    assert all(1 <= len(p) <= 2 for p in entries[1:])
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
    assert plain.prompt_logprobs is None  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "extra", [{"prompt_logprobs": -1}, {"prompt_logprobs": MAX_LOGPROBS + 1},
              {"prompt_logprobs": -2}, {"prompt_logprobs": 1, "stream": True}],
    ids=["whole-vocabulary", "over-the-max", "negative", "streamed"],
)  # fmt: skip
def test_prompt_logprobs_out_of_range_is_a_400(client: openai.OpenAI, extra: dict) -> None:
    for create, args in (
        (client.completions.create, {"prompt": PROMPT}),
        (client.chat.completions.create, {"messages": MESSAGES}),
    ):
        error = bad_request(
            lambda create=create, args=args: create(
                model=MODEL_NAME, max_tokens=2, extra_body=extra, **args
            )
        )
        assert error_of(error)["param"] == "prompt_logprobs", error.message


# --- token ids --------------------------------------------------------------------------


def test_return_token_ids_on_completions(client: openai.OpenAI, live: LiveServer) -> None:
    args = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    args["extra_body"] = {"return_token_ids": True, "ignore_eos": True}
    whole = client.completions.create(**args)  # type: ignore[call-overload]
    choice = whole.choices[0]
    assert choice.prompt_token_ids == tokenize(live, PROMPT)  # type: ignore[attr-defined]
    assert len(choice.token_ids) == whole.usage.completion_tokens == 6  # type: ignore[attr-defined]
    chunks = [c for c in client.completions.create(stream=True, **args) if c.choices]
    assert chunks[0].choices[0].prompt_token_ids == choice.prompt_token_ids  # type: ignore[attr-defined]
    assert all(c.choices[0].model_extra.get("prompt_token_ids") is None for c in chunks[1:])
    streamed = [t for c in chunks for t in c.choices[0].token_ids]  # type: ignore[attr-defined]
    assert streamed == choice.token_ids  # type: ignore[attr-defined]
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert plain.choices[0].token_ids is None  # type: ignore[attr-defined]
    assert plain.choices[0].prompt_token_ids is None  # type: ignore[attr-defined]


def test_return_token_ids_on_chat(client: openai.OpenAI) -> None:
    args = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    args["extra_body"] = {"return_token_ids": True, "ignore_eos": True}
    whole = client.chat.completions.create(**args)  # type: ignore[call-overload]
    prompt_ids = whole.prompt_token_ids  # type: ignore[attr-defined]
    assert len(prompt_ids) == whole.usage.prompt_tokens
    assert len(whole.choices[0].token_ids) == 6  # type: ignore[attr-defined]
    chunks = list(client.chat.completions.create(stream=True, **args))  # type: ignore[call-overload]
    assert chunks[0].prompt_token_ids == prompt_ids  # type: ignore[attr-defined]
    assert all("prompt_token_ids" not in (c.model_extra or {}) for c in chunks[1:])
    streamed = [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids") or []]
    assert streamed == whole.choices[0].token_ids  # type: ignore[attr-defined]


def test_return_tokens_as_token_ids(client: openai.OpenAI) -> None:
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, logprobs=2, extra_body=extra
    )
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.top_logprobs
    ids = [int(t.removeprefix("token_id:")) for t in logprobs.tokens]
    assert ids == out.choices[0].token_ids  # type: ignore[attr-defined]
    assert all(k.startswith("token_id:") for top in logprobs.top_logprobs for k in top)
    assert [next(iter(top)) for top in logprobs.top_logprobs] == logprobs.tokens  # vLLM's order
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2,
        extra_body=extra,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [int(c.token.removeprefix("token_id:")) for c in content] == chat.choices[0].token_ids  # type: ignore[attr-defined]
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, logprobs=1)
    assert not any(t.startswith("token_id:") for t in plain.choices[0].logprobs.tokens)  # type: ignore[union-attr]


def test_chat_echo_starts_the_reply_with_the_last_message(client: openai.OpenAI) -> None:
    saying = "An apple a day keeps"
    messages = [{"role": "user", "content": "A saying?"}, {"role": "assistant", "content": saying}]
    args = {"model": MODEL_NAME, "messages": messages, "max_tokens": 4, "temperature": 0}
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    plain = client.chat.completions.create(**args, extra_body=extra)  # type: ignore[call-overload]
    echoed = client.chat.completions.create(**args, extra_body={**extra, "echo": True})  # type: ignore[call-overload]
    content = plain.choices[0].message.content or ""
    assert echoed.choices[0].message.content == saying + content
    chunks = client.chat.completions.create(**args, extra_body={**extra, "echo": True}, stream=True)  # type: ignore[call-overload]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == saying + content


# --- usage ------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats(client: openai.OpenAI, endpoint: str) -> None:
    create, args = (
        (client.completions.create, {"prompt": PROMPT})
        if endpoint == "completions"
        else (client.chat.completions.create, {"messages": MESSAGES})
    )
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        create(
            model=MODEL_NAME,
            max_tokens=5,
            stream=True,
            stream_options=options,
            extra_body={"ignore_eos": True},
            **args,
        )  # fmt: skip
    )
    *choices, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5
    counts = [c.usage.completion_tokens for c in choices]
    assert all(c.usage is not None for c in choices) and counts == sorted(counts)
    assert counts[-1] == 5 and all(
        c.usage.prompt_tokens == last.usage.prompt_tokens for c in choices
    )
    plain = list(create(model=MODEL_NAME, max_tokens=3, stream=True,
                        stream_options={"include_usage": True}, **args))  # fmt: skip
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage is not None


def cold(text: str) -> str:
    """A prompt no request of the session sent before: nothing of it can be cached."""
    return f"{uuid.uuid4().hex} {text}"


def test_cached_tokens_present_and_zero_on_a_cold_prompt(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL_NAME, prompt=cold(PROMPT), max_tokens=2)
    assert whole.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    messages = [{"role": "user", "content": cold("Say something.")}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert chat.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    messages = [{"role": "user", "content": cold("Say something.")}]
    streamed = list(
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2,  # type: ignore[arg-type]
                                       stream=True, stream_options={"include_usage": True})
    )  # fmt: skip
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    response = client.responses.create(model=MODEL_NAME, input=cold("Hi"), max_output_tokens=2)
    assert response.usage.input_tokens_details.cached_tokens == 0  # type: ignore[union-attr]


# --- truncation -------------------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_n(client: openai.OpenAI, live: LiveServer) -> None:
    ids = tokenize(live, PROMPT)
    kept = {}
    for side in (None, "left", "right"):
        extra = {"truncate_prompt_tokens": 4, "return_token_ids": True}
        if side is not None:
            extra["truncation_side"] = side
        out = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=1, echo=True, extra_body=extra
        )
        assert out.usage.prompt_tokens == 4
        kept[side] = out.choices[0].prompt_token_ids  # type: ignore[attr-defined]
    assert kept[None] == kept["left"] == ids[-4:] and kept["right"] == ids[:4]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=1,
        extra_body={"truncate_prompt_tokens": 3},
    )  # fmt: skip
    assert chat.usage.prompt_tokens == 3
    # -1: as long as the engine takes; a prompt past it is cut to fit, not refused
    long_prompt = " ".join(["fox"] * 300)
    cut = client.completions.create(
        model=MODEL_NAME, prompt=long_prompt, max_tokens=1,
        extra_body={"truncate_prompt_tokens": -1},
    )  # fmt: skip
    assert cut.usage.prompt_tokens == live.config.max_model_len - 1  # type: ignore[operator]


@pytest.mark.parametrize("value", [0, 129, -2])
def test_truncate_prompt_tokens_out_of_range_is_a_400(client: openai.OpenAI, value: int) -> None:
    error = bad_request(
        lambda: client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=1,
            extra_body={"truncate_prompt_tokens": value},
        )
    )  # fmt: skip
    assert error_of(error)["param"] == "truncate_prompt_tokens", error.message


# --- stop_reason ------------------------------------------------------------------------


def test_stop_reason_names_what_ended_the_choice(client: openai.OpenAI) -> None:
    args = {"model": MODEL_NAME, "prompt": PROMPT, "temperature": 0, "max_tokens": 16}
    free = client.completions.create(
        **args, extra_body={"ignore_eos": True, "return_token_ids": True}
    )  # type: ignore[call-overload]
    assert free.choices[0].finish_reason == "length" and free.choices[0].stop_reason is None  # type: ignore[attr-defined]
    stop = pick_stop(free.choices[0].text, 2)
    by_string = client.completions.create(**args, stop=[stop])  # type: ignore[call-overload]
    assert by_string.choices[0].finish_reason == "stop"
    assert by_string.choices[0].stop_reason == stop  # type: ignore[attr-defined]
    token = free.choices[0].token_ids[3]  # type: ignore[attr-defined]
    by_token = client.completions.create(**args, extra_body={"stop_token_ids": [token]})  # type: ignore[call-overload]
    assert by_token.choices[0].stop_reason == token  # type: ignore[attr-defined]
    chunks = [c for c in client.completions.create(**args, stop=[stop], stream=True) if c.choices]  # type: ignore[call-overload]
    assert chunks[-1].choices[0].stop_reason == stop  # type: ignore[attr-defined]
    chat_args = {"model": MODEL_NAME, "messages": MESSAGES, "temperature": 0, "max_tokens": 16}
    chat_free = client.chat.completions.create(**chat_args, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    chat_stop = pick_stop(chat_free.choices[0].message.content or "", 2)
    chat = client.chat.completions.create(**chat_args, stop=[chat_stop])  # type: ignore[call-overload]
    assert chat.choices[0].stop_reason == chat_stop  # type: ignore[attr-defined]
    chat_chunks = list(client.chat.completions.create(**chat_args, stop=[chat_stop], stream=True))  # type: ignore[call-overload]
    assert chat_chunks[-1].choices[0].stop_reason == chat_stop  # type: ignore[attr-defined]


# --- repetition_penalty -----------------------------------------------------------------


def test_repetition_penalty_reaches_the_engine_and_bad_values_are_400s(
    client: openai.OpenAI,
) -> None:
    """The engine's rule is checked against transformers (tests/engine/core/test_core.py);
    here: completions and chat take it, it changes a greedy reply that repeats itself, and
    a value not above 0, or one with beam search, is a 400 naming it."""
    args = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    extra = {"ignore_eos": True, "return_token_ids": True}
    plain = client.completions.create(**args, extra_body=extra).choices[0]  # type: ignore[call-overload]
    ids = plain.token_ids  # type: ignore[attr-defined]
    assert len(set(ids)) < len(ids)  # the random model repeats itself...
    penalized = client.completions.create(  # type: ignore[call-overload]
        **args, extra_body={**extra, "repetition_penalty": 2.0}
    ).choices[0]
    assert penalized.token_ids != ids  # type: ignore[attr-defined]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=4, extra_body={"repetition_penalty": 1.2}
    )
    assert chat.choices[0].message.content is not None
    for bad in ({"repetition_penalty": 0}, {"repetition_penalty": 1.2, "use_beam_search": True}):
        error = bad_request(
            lambda bad=bad: client.completions.create(
                model=MODEL_NAME, prompt=PROMPT, max_tokens=2, n=2, extra_body=bad
            )
        )
        assert error_of(error)["param"] == "repetition_penalty", error.message


# --- fields not served, fields no one reads ---------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [{"kv_transfer_params": {"do_remote_decode": True}}],
    ids=lambda extra: next(iter(extra)),
)  # fmt: skip
def test_fields_not_served_are_400s_naming_them(client: openai.OpenAI, extra: dict) -> None:
    (field,) = extra
    for create, args in (
        (client.completions.create, {"prompt": PROMPT, "logprobs": 1}),
        (client.chat.completions.create, {"messages": MESSAGES, "logprobs": True}),
    ):
        error = bad_request(
            lambda create=create, args=args: create(
                model=MODEL_NAME, max_tokens=2, extra_body=extra, **args
            )
        )
        body = error_of(error)
        assert body["param"] == field and "not supported" in body["message"], body


def test_unknown_fields_are_ignored_with_one_warning(
    client: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="server.params"):
        out = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=2,
            extra_body={"no_such_field": 1, "another_one": "x"},
        )  # fmt: skip
    assert out.choices[0].text is not None
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(warnings) == 1 and "another_one" in warnings[0] and "no_such_field" in warnings[0]


# --- item 6: the tool's constraint wins --------------------------------------------------

LIGHT = {
    "type": "object",
    "properties": {"room": {"enum": ["hall", "den"]}, "on": {"type": "boolean"}},
    "required": ["room", "on"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "set_light", "parameters": LIGHT}}]
NUMBER = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
OTHER_FORMAT = {"type": "json_schema", "json_schema": {"name": "n", "schema": NUMBER}}


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "set_light"}}],
    ids=["required", "named"],
)  # fmt: skip
def test_tool_choice_wins_over_response_format(client: openai.OpenAI, choice: object) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Turn off the hall light."}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=choice,  # type: ignore[arg-type]
        response_format=OTHER_FORMAT,  # type: ignore[arg-type]
        max_tokens=90,
        seed=3,  # "required" takes any number of calls: random weights may add calls past
    )  # any budget (tests/server/test_tools.py); this seed's list closes
    calls = out.choices[0].message.tool_calls or []
    assert calls and all(c.function.name == "set_light" for c in calls)  # type: ignore[union-attr]
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), LIGHT)  # type: ignore[union-attr]


def test_responses_tool_choice_wins_over_text_format(client: openai.OpenAI) -> None:
    flat = [{"type": "function", **tool["function"]} for tool in TOOLS]
    response = client.responses.create(
        model=MODEL_NAME,
        input="Turn off the hall light.",
        tools=flat,  # type: ignore[arg-type]
        tool_choice={"type": "function", "name": "set_light"},
        text={"format": {"type": "json_object"}},
        max_output_tokens=90,
    )
    [call] = [o for o in response.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), LIGHT)  # type: ignore[union-attr]


# --- item 7: every bad value named ------------------------------------------------------


def test_every_bad_logit_bias_key_is_named(client: openai.OpenAI, live: LiveServer) -> None:
    error = bad_request(
        lambda: client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
            logit_bias={"bad1": 50.0, "bad2": 20.0, "3": 1.0},
        )
    )  # fmt: skip
    assert "bad1" in error.message and "bad2" in error.message
    assert error_of(error)["param"] == "logit_bias"
    size = vocab_size(live)
    over = bad_request(
        lambda: client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=2,
            logit_bias={str(size): 1.0, str(size + 7): 1.0, "5": 1.0},
        )
    )  # fmt: skip
    message = error_of(over)["message"]
    assert "out of vocabulary" in message and str(size) in message and str(size + 7) in message
    allowed = bad_request(
        lambda: client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=2,
            extra_body={"allowed_token_ids": [1, size + 1, size + 2]},
        )
    )  # fmt: skip
    message = error_of(allowed)["message"]
    assert error_of(allowed)["param"] == "allowed_token_ids" and "out of vocabulary" in message
    assert str(size + 1) in message and str(size + 2) in message


def test_every_out_of_vocabulary_prompt_id_is_named(
    client: openai.OpenAI, live: LiveServer
) -> None:
    size = vocab_size(live)
    error = bad_request(
        lambda: client.completions.create(
            model=MODEL_NAME, prompt=[1, size, 2, size + 3], max_tokens=2
        )
    )
    message = error_of(error)["message"]
    assert "out of vocabulary" in message and f"vocabulary size {size}" in message
    assert f"{size} at position 1" in message and f"{size + 3} at position 3" in message


def test_roles_stay_openais(client: openai.OpenAI) -> None:
    """A deliberate difference from vLLM, which passes any role to the template."""
    error = bad_request(
        lambda: client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "narrator", "content": "x"}],
            max_tokens=2,  # type: ignore[list-item]
        )
    )
    assert error_of(error)["param"] == "messages"
