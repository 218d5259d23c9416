"""Validated OpenAI requests -> the engine's `ActiveRequest`s.

Owns every check that needs the model or the server's limits: prompt and
context length, prompt truncation (vLLM's truncate_prompt_tokens), n, stop
strings, logprobs and prompt logprobs, token ids (every out-of-vocabulary id is
named; logit_bias and allowed_token_ids are then asked of SamplingParams),
structured outputs (compiled by server.structured). Each failure is a 400
`APIError` whose `param` names the field, raised before anything is queued.
Fields no model reads are logged here, once per request.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine.types import (
    MAX_LOGPROBS,
    PromptTooLongError,
    SamplingParams,
    TokenConstraint,
    TokenLogprobs,
)
from frontend.request import ActiveRequest
from server.backend import ModelLimits, TokenizerClient
from server.beam_plan import BeamSettings, beam_settings
from server.config import ServerConfig
from server.errors import APIError, bad_request
from server.protocol import CompletionRequest, RequestModel, SamplingFields
from server.structured import compile_constraint, requested
from server.tools import ToolPlan

logger = logging.getLogger(__name__)

NEG_INF_LOGPROB = -9999.0  # JSON has no -inf; vLLM reports this value instead
SHOWN_VALUES = 64  # bad values an error message lists before "and N more"


def finite(logprob: float) -> float:
    """A logprob JSON can carry: -inf (and NaN) become NEG_INF_LOGPROB."""
    return logprob if math.isfinite(logprob) else NEG_INF_LOGPROB


@dataclass(frozen=True)
class PromptInput:
    """One prompt as token ids, and as text when echo needs it."""

    ids: tuple[int, ...]
    text: str
    specials_shown: bool = False  # the text is decoded ids, special tokens included


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
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: top-k per prompt position
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and token_ids in the reply
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:N" tokens
    picks_ids: bool = False  # vLLM's logprob_token_ids: alternatives are those ids, all of them
    beam: BeamSettings | None = None  # vLLM's use_beam_search: server.beam runs the search
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage per chunk

    def alternatives(self, lp: TokenLogprobs) -> tuple[tuple[int, float], ...]:
        """A generated position's alternatives as its logprobs list them: the top
        `logprobs`, or with logprob_token_ids the sampled token then each id asked, once
        each, whatever `logprobs` says (vLLM's)."""
        if not self.picks_ids:
            return lp.top[: self.logprobs or 0]
        seen: dict[int, float] = {lp.token_id: lp.logprob}
        for token, logprob in lp.top:
            seen.setdefault(token, logprob)
        return tuple(seen.items())


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
    items: Sequence[str | list[int]],
    tokenizer: TokenizerClient,
    request: SamplingFields,
    limits: ModelLimits,
) -> tuple[PromptInput, ...]:
    """Each prompt as token ids (and text, for echo), truncated as the request asks."""
    out = []
    for item in items:
        if isinstance(item, str):
            ids, text = _encode(tokenizer, item), item
        else:
            check_token_ids(tokenizer, item, "prompt")
            ids, text = list(item), None
        kept = truncate(ids, request, limits)
        if text is not None and len(kept) == len(ids):
            out.append(PromptInput(kept, text))
        else:  # echoed as vLLM echoes ids: decoded, special tokens shown
            decoded = tokenizer.decode(kept, skip_special_tokens=False)
            out.append(PromptInput(kept, decoded, specials_shown=True))
    return tuple(out)


def truncate(ids: Sequence[int], request: SamplingFields, limits: ModelLimits) -> tuple[int, ...]:
    """vLLM's truncate_prompt_tokens: keep N of the prompt's tokens, the last N unless
    truncation_side is "right"; -1 keeps as many as the engine takes."""
    keep = request.truncate_prompt_tokens
    if keep is None or (keep == -1 and len(ids) <= limits.max_prompt_len):
        return tuple(ids)
    if keep == 0:
        raise bad_request(
            "truncate_prompt_tokens must be -1 (the longest prompt served) or >= 1, got 0",
            param="truncate_prompt_tokens",
        )
    if keep > limits.max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = "
            f"{limits.max_model_len}. Please request a smaller truncation size.",
            param="truncate_prompt_tokens",
        )
    if keep == -1:
        keep = limits.max_prompt_len
    if len(ids) <= keep:
        return tuple(ids)
    return tuple(ids[:keep] if request.truncation_side == "right" else ids[-keep:])


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


def listing(values: Sequence[object]) -> str:
    """Values for an error message: all of them, or the first SHOWN_VALUES and a count."""
    shown = ", ".join(str(v) for v in values[:SHOWN_VALUES])
    more = len(values) - SHOWN_VALUES
    return f"[{shown}{f', ... and {more} more' if more > 0 else ''}]"


def check_vocab(param: str, ids: Sequence[int], vocab_size: int) -> None:
    """A 400 naming every id of `param` outside the model's vocabulary, as vLLM's does."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(
            f"token_id(s) {listing(bad)} in {param} are out of vocabulary: the vocabulary "
            f"size is {vocab_size} (valid ids are 0..{vocab_size - 1})",
            param=param,
        )


def note_ignored(request: RequestModel) -> None:
    """One warning per request naming the fields no model here reads (vLLM ignores them
    too); names are cut short, so a hostile body cannot flood the log."""
    names = request.ignored_fields
    if names:
        shown = [name if len(name) <= 64 else name[:61] + "..." for name in names[:32]]
        logger.warning(
            "request fields ignored (this server does not read them): %s%s",
            ", ".join(shown),
            f" and {len(names) - 32} more" if len(names) > 32 else "",
        )


def prompt_logprobs(request: SamplingFields) -> int | None:
    """vLLM's prompt_logprobs: the top k alternatives at each prompt position (0..20)."""
    k = request.prompt_logprobs
    if k is None:
        return None
    if k == -1:
        raise bad_request(
            f"prompt_logprobs=-1 (every token of the vocabulary) is not supported: ask for "
            f"at most {MAX_LOGPROBS}",
            param="prompt_logprobs",
            code="unsupported",
        )
    if not 0 <= k <= MAX_LOGPROBS:
        raise bad_request(
            f"prompt_logprobs must be in 0..{MAX_LOGPROBS} (the most alternatives served), got {k}",
            param="prompt_logprobs",
        )
    if request.stream:
        raise bad_request(
            "prompt_logprobs are not available when stream=True", param="prompt_logprobs"
        )
    return k


def check_common(request: SamplingFields, config: ServerConfig, model_name: str) -> None:
    """Checks shared by both endpoints: model, unsupported fields, n, stream_options; the
    fields no one reads are logged."""
    note_ignored(request)
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


def logit_bias(request: SamplingFields, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias}) as (id, bias) pairs; every key that is not
    an id, then every id out of the vocabulary, is named. The count and the range are
    SamplingParams' rules (the engine owns them)."""
    entries = request.logit_bias or {}
    bad = [key for key in entries if not _TOKEN_KEY.fullmatch(key)]
    if bad:
        keys = listing([repr(key if len(key) <= 32 else key[:29] + "...") for key in bad])
        raise bad_request(
            f"logit_bias contains key(s) that cannot be converted to integer token ids: {keys}",
            param="logit_bias",
        )
    pairs = tuple((int(key), bias) for key, bias in entries.items())
    check_vocab("logit_bias", [token for token, _ in pairs], vocab_size)
    return pairs


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
    if request.allowed_token_ids:
        check_vocab("allowed_token_ids", request.allowed_token_ids, limits.vocab_size)
    picked = request.logprob_token_ids
    if picked:
        check_vocab("logprob_token_ids", picked, limits.vocab_size)
    bias = logit_bias(request, limits.vocab_size)
    try:
        sampling = SamplingParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_k=top_k,
            top_p=1.0 if request.top_p is None else request.top_p,
            seed=request.seed,
            logprobs=logprobs,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=(
                1.0 if request.repetition_penalty is None else request.repetition_penalty
            ),
            min_tokens=request.min_tokens,
            logit_bias=bias,
            allowed_token_ids=(
                None if request.allowed_token_ids is None else tuple(request.allowed_token_ids)
            ),
            constraint=constraint,
            logprob_token_ids=None if picked is None else tuple(picked),
        )
    except ValueError as exc:  # SamplingError names its field
        raise bad_request(str(exc), param=getattr(exc, "param", None)) from exc
    return sampling


def check_length(prompt_len: int, max_tokens: int | None, limits: ModelLimits, param: str) -> None:
    """400 when the prompt does not fit, or prompt + max_tokens exceeds the context.

    The rule is the engine's (EngineLimits.check), the same the engine client applies.
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
    prompt_logprobs: int | None,
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
    if request.logprob_token_ids and request.echo and request.max_tokens == 0:
        raise bad_request(
            "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because "
            "no output tokens are generated.",
            param="logprob_token_ids",
        )
    items = prompt_items(request, config)
    check_samples(len(items), request.n, config)
    # vLLM's: echo with logprobs asks for the prompt's logprobs, as many alternatives
    top_prompt = prompt_logprobs(request)
    if top_prompt is None and request.echo:
        top_prompt = request.logprobs
    asked = requested(request)
    beam = beam_settings(request, request.max_tokens, constrained=asked is not None)
    constraint = compile_constraint(asked, tokenizer, limits)
    sampling = sampling_params(request, request.logprobs, request.max_tokens, limits, constraint)
    prompts = resolve_prompts(items, tokenizer, request, limits)
    stop = stop_strings(request, config)
    requests = build_requests(
        base_id,
        prompts,
        request,
        max_tokens=request.max_tokens,
        sampling=sampling,
        stop=stop,
        prompt_logprobs=top_prompt,
        limits=limits,
        tokenizer=tokenizer,
        prompt_param="prompt",
    )
    return with_extensions(
        GenerationPlan(
            requests=requests,
            prompts=prompts,
            n=request.n,
            stream=request.stream,
            include_usage=False,
            echo=request.echo,
            logprobs=request.logprobs,
            discard_output=request.max_tokens == 0,
            prompt_logprobs=top_prompt,
            beam=beam,
        ),
        request,
    )


def with_extensions(plan: GenerationPlan, request: SamplingFields) -> GenerationPlan:
    """The plan with what the request asks of the response's shape: usage in the stream
    (OpenAI's include_usage, vLLM's continuous_usage_stats with it, as vLLM reads them),
    vLLM's token ids, "token_id:N" tokens and logprob_token_ids' alternatives."""
    options = request.stream_options
    include_usage = bool(options and options.include_usage)
    return replace(
        plan,
        include_usage=include_usage,
        continuous_usage=include_usage and bool(options and options.continuous_usage_stats),
        return_token_ids=bool(request.return_token_ids),
        tokens_as_ids=bool(request.return_tokens_as_token_ids),
        picks_ids=bool(request.logprob_token_ids),
    )
