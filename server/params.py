"""Validated OpenAI requests -> the orchestrator's `ActiveRequest`s.

Owns every check that needs the model or the server's limits: prompt and
context length, n, stop strings, logprobs, token ids (logit_bias and
allowed_token_ids asked of SamplingParams), structured outputs (compiled by
server.structured). Each failure is a 400
`APIError` whose `param` names the field, raised before anything is queued.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from engine.request import ActiveRequest
from engine.types import PromptTooLongError, SamplingParams, TokenConstraint
from server.backend import ModelLimits, TokenizerClient
from server.config import ServerConfig
from server.errors import APIError, bad_request
from server.protocol import CompletionRequest, SamplingFields
from server.structured import compile_constraint, requested
from server.tools import ToolPlan

NEG_INF_LOGPROB = -9999.0  # JSON has no -inf; vLLM reports this value instead


def finite(logprob: float) -> float:
    """A logprob JSON can carry: -inf (and NaN) become NEG_INF_LOGPROB."""
    return logprob if math.isfinite(logprob) else NEG_INF_LOGPROB


@dataclass(frozen=True)
class PromptInput:
    """One prompt as token ids, and as text when echo needs it."""

    ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class GenerationPlan:
    """Everything a handler needs to run a request and shape its response."""

    requests: tuple[ActiveRequest, ...]  # one per prompt, each with n samples
    prompts: tuple[PromptInput, ...]
    n: int
    stream: bool
    include_usage: bool
    echo: bool = False
    logprobs: int | None = None  # completions: top-N; chat: top_logprobs when logprobs=true
    discard_output: bool = False  # max_tokens=0: return only the (echoed) prompt
    tools: ToolPlan | None = None  # chat: the tools the prompt shows and the reply may call


def prompt_items(request: CompletionRequest, config: ServerConfig) -> list[str | list[int]]:
    """A completions `prompt` (string, strings, ids or lists of ids) as a list of prompts."""
    prompt = request.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [list(prompt)]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if len(items) > config.max_prompts:
        raise bad_request(
            f"at most {config.max_prompts} prompts per request (max_prompts), got {len(items)}",
            param="prompt",
        )
    return items


def resolve_prompts(
    items: Sequence[str | list[int]], tokenizer: TokenizerClient
) -> tuple[PromptInput, ...]:
    """Each prompt as token ids (and text, for echo)."""
    out = []
    for item in items:
        if isinstance(item, str):
            ids = _encode(tokenizer, item)
            out.append(PromptInput(tuple(ids), item))
        else:
            check_token_ids(tokenizer, item, "prompt")
            out.append(PromptInput(tuple(item), tokenizer.decode(item)))
    return tuple(out)


def _encode(tokenizer: TokenizerClient, text: str) -> list[int]:
    try:
        ids = tokenizer.encode(text)
    except ValueError as exc:
        raise bad_request(f"prompt could not be tokenized: {exc}", param="prompt") from exc
    if not ids:
        raise bad_request("prompt must contain at least one token", param="prompt")
    return ids


def check_token_ids(tokenizer: TokenizerClient, ids: Sequence[int], param: str) -> None:
    if not ids:
        raise bad_request(f"{param} must contain at least one token", param=param)
    try:
        tokenizer.validate_ids(ids)
    except ValueError as exc:
        raise bad_request(f"{param}: {exc}", param=param) from exc


def check_common(request: SamplingFields, config: ServerConfig, model_name: str) -> None:
    """Checks shared by both endpoints: model, unsupported fields, n, stream_options."""
    if request.model is not None and request.model != model_name:
        raise APIError(
            404,
            f"The model `{request.model}` does not exist.",
            param="model",
            code="model_not_found",
        )
    unsupported = request.unsupported()
    if unsupported is not None:
        raise bad_request(unsupported[1], param=unsupported[0], code="unsupported")
    if request.n > config.max_n:
        raise bad_request(f"n must be <= {config.max_n} (max_n), got {request.n}", param="n")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def check_samples(prompts: int, n: int, config: ServerConfig) -> None:
    """400 when prompts x n exceeds what one request may hold of the admission queue."""
    samples = prompts * n
    limit, flag = config.request_sample_limit
    if samples > limit:
        raise bad_request(
            f"a request may ask for at most {limit} samples ({flag}, counted as prompts x n), "
            f"got {prompts} x {n} = {samples}",
            param="n",
        )


def stop_strings(request: SamplingFields, config: ServerConfig) -> tuple[str, ...]:
    stop = request.stop
    items = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(items) > config.max_stop_strings:
        raise bad_request(
            f"at most {config.max_stop_strings} stop strings (max_stop_strings), got {len(items)}",
            param="stop",
        )
    for item in items:
        if not item:
            raise bad_request("stop strings must not be empty", param="stop")
        if len(item) > config.max_stop_string_chars:
            raise bad_request(
                f"stop strings must be at most {config.max_stop_string_chars} characters "
                f"(max_stop_string_chars), got {len(item)}",
                param="stop",
            )
    return items


_TOKEN_KEY = re.compile(r"-?[0-9]{1,12}")  # a JSON object key naming a token id


def logit_bias(request: SamplingFields) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias}) as (id, bias) pairs; the count, the range and
    the ids are SamplingParams' rules (the engine owns them)."""
    pairs = []
    for key, bias in (request.logit_bias or {}).items():
        if not _TOKEN_KEY.fullmatch(key):
            raise bad_request(
                f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                param="logit_bias",
            )
        pairs.append((int(key), bias))
    return tuple(pairs)


def sampling_params(
    request: SamplingFields,
    logprobs: int | None,
    max_tokens: int | None,
    limits: ModelLimits,
    constraint: TokenConstraint | None = None,
) -> SamplingParams:
    """The engine's sampling parameters; bounds that need the model are checked here.
    `constraint`: the compiled structured-output constraint (server.structured)."""
    top_k = request.top_k if request.top_k is not None and request.top_k > 0 else 0
    if top_k > limits.vocab_size:
        raise bad_request(
            f"top_k must be -1 or 0 (off) or at most the vocabulary size {limits.vocab_size}, "
            f"got {top_k}",
            param="top_k",
        )
    token_budget = limits.max_model_len if max_tokens is None else max_tokens
    if request.min_tokens > token_budget:
        raise bad_request(
            f"min_tokens must be <= max_tokens ({token_budget}), got {request.min_tokens}",
            param="min_tokens",
        )
    try:
        sampling = SamplingParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_k=top_k,
            top_p=1.0 if request.top_p is None else request.top_p,
            seed=request.seed,
            logprobs=logprobs,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            min_tokens=request.min_tokens,
            logit_bias=logit_bias(request),
            allowed_token_ids=(
                None if request.allowed_token_ids is None else tuple(request.allowed_token_ids)
            ),
            constraint=constraint,
        )
        sampling.check_vocab(limits.vocab_size)
    except ValueError as exc:  # SamplingError names its field
        raise bad_request(str(exc), param=getattr(exc, "param", None)) from exc
    return sampling


def check_length(prompt_len: int, max_tokens: int | None, limits: ModelLimits, param: str) -> None:
    """400 when the prompt does not fit, or prompt + max_tokens exceeds the context.

    The rule is the engine's (EngineLimits.check), the same the orchestrator applies.
    """
    try:
        limits.check(prompt_len, max_tokens)
    except PromptTooLongError as exc:
        blamed = param if exc.param == "prompt" else exc.param
        raise bad_request(str(exc), param=blamed, code="context_length_exceeded") from exc


def build_requests(
    base_id: str,
    prompts: Sequence[PromptInput],
    request: SamplingFields,
    *,
    max_tokens: int | None,
    sampling: SamplingParams,
    stop: tuple[str, ...],
    prompt_logprobs: bool,
    limits: ModelLimits,
    tokenizer: TokenizerClient,
    prompt_param: str,
) -> tuple[ActiveRequest, ...]:
    """One ActiveRequest per prompt; max_tokens 0 runs one token that is then discarded."""
    stop_token_ids = tuple(request.stop_token_ids or ())
    if stop_token_ids:
        check_token_ids(tokenizer, stop_token_ids, "stop_token_ids")
    out = []
    for i, prompt in enumerate(prompts):
        check_length(len(prompt.ids), max_tokens, limits, prompt_param)
        try:
            out.append(
                ActiveRequest(
                    request_id=f"{base_id}-{i}",
                    prompt_ids=prompt.ids,
                    sampling=sampling,
                    max_tokens=None if max_tokens is None else max(1, max_tokens),
                    n=request.n,
                    stop=stop,
                    stop_token_ids=stop_token_ids,
                    ignore_eos=request.ignore_eos,
                    include_stop_str_in_output=request.include_stop_str_in_output,
                    prompt_logprobs=prompt_logprobs,
                    skip_special_tokens=request.skip_special_tokens,
                )
            )
        except ValueError as exc:
            raise bad_request(str(exc)) from exc
    return tuple(out)


def plan_completion(
    base_id: str,
    request: CompletionRequest,
    tokenizer: TokenizerClient,
    config: ServerConfig,
    limits: ModelLimits,
) -> GenerationPlan:
    check_common(request, config, config.model_name)
    if request.suffix:
        raise bad_request("suffix is not supported", param="suffix", code="unsupported")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request(
            f"best_of must equal n (best_of > n is not supported), got best_of="
            f"{request.best_of}, n={request.n}",
            param="best_of",
        )
    if request.max_tokens == 0 and request.stream:
        raise bad_request("max_tokens must be >= 1 when streaming", param="max_tokens")
    items = prompt_items(request, config)
    check_samples(len(items), request.n, config)
    constraint = compile_constraint(requested(request), tokenizer, limits)
    sampling = sampling_params(request, request.logprobs, request.max_tokens, limits, constraint)
    prompts = resolve_prompts(items, tokenizer)
    stop = stop_strings(request, config)
    requests = build_requests(
        base_id,
        prompts,
        request,
        max_tokens=request.max_tokens,
        sampling=sampling,
        stop=stop,
        prompt_logprobs=request.echo and request.logprobs is not None,
        limits=limits,
        tokenizer=tokenizer,
        prompt_param="prompt",
    )
    return GenerationPlan(
        requests=requests,
        prompts=prompts,
        n=request.n,
        stream=request.stream,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        echo=request.echo,
        logprobs=request.logprobs,
        discard_output=request.max_tokens == 0,
    )
