"""A request's beam search: its settings, read and checked while the request is planned.

Runs on: the server's tokenizer threads (the planners). Owns: which fields ask for a beam
search (vLLM's `use_beam_search` with `n` beams, `length_penalty`, `early_stopping`,
`include_stop_str_in_output`, `ignore_eos`) and its 400s: vLLM's (streaming,
logprob_token_ids, n past the logprobs a step needs) and one for each field a beam search
would otherwise ignore. server.beam runs the search.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.types import MAX_LOGPROBS
from server.errors import bad_request
from server.protocol import SamplingFields

MAX_WIDTH = MAX_LOGPROBS // 2  # each step asks for 2 x width logprobs, at most MAX_LOGPROBS


@dataclass(frozen=True)
class BeamSettings:
    """What a beam-search request asks (vLLM's BeamSearchParams)."""

    width: int  # the request's n
    max_tokens: int | None  # steps at most; None: as many as the context has room for
    length_penalty: float = 1.0
    early_stopping: bool = False
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


# Fields beam search does not read; set, they would be ignored, so each is a 400 instead.
_NOT_WITH_BEAMS: tuple[tuple[str, Callable[[SamplingFields], bool]], ...] = (
    ("stop", lambda r: bool(r.stop)),
    ("stop_token_ids", lambda r: bool(r.stop_token_ids)),
    ("min_tokens", lambda r: r.min_tokens > 0),
    ("logit_bias", lambda r: bool(r.logit_bias)),
    ("allowed_token_ids", lambda r: r.allowed_token_ids is not None),
    ("presence_penalty", lambda r: bool(r.presence_penalty)),
    ("frequency_penalty", lambda r: bool(r.frequency_penalty)),
    ("repetition_penalty", lambda r: r.repetition_penalty not in (None, 1.0)),
    ("prompt_logprobs", lambda r: r.prompt_logprobs is not None),
)


def beam_settings(
    request: SamplingFields, max_tokens: int | None, constrained: bool
) -> BeamSettings | None:
    """The request's beam search, or None without `use_beam_search`; 400s as vLLM's
    (streaming, logprob_token_ids, n past the logprobs it needs) and for each field beam
    search would ignore. `constrained`: the request asks for a structured output."""
    if not request.use_beam_search:
        return None
    if request.stream:
        raise bad_request(
            "Streaming is not currently supported with beam search", param="use_beam_search"
        )
    if request.logprob_token_ids:
        raise bad_request(
            "`logprob_token_ids` is not supported with beam search.", param="logprob_token_ids"
        )
    if max_tokens == 0:
        raise bad_request("max_tokens must be >= 1 with beam search", param="max_tokens")
    if request.n > MAX_WIDTH:
        raise bad_request(
            f"beam search with n={request.n} asks for 2 x n = {2 * request.n} logprobs a step, "
            f"which is greater than max allowed: {MAX_LOGPROBS} (n <= {MAX_WIDTH})",
            param="n",
        )
    for field, is_set in _NOT_WITH_BEAMS:
        if is_set(request):
            raise bad_request(
                f"{field} is not supported with beam search", param=field, code="unsupported"
            )
    if constrained:
        raise bad_request(
            "structured outputs (response_format, structured_outputs, guided_*, tool_choice "
            "required or named) are not supported with beam search",
            param="use_beam_search",
            code="unsupported",
        )
    return BeamSettings(
        width=request.n,
        max_tokens=max_tokens,
        length_penalty=1.0 if request.length_penalty is None else request.length_penalty,
        early_stopping=request.early_stopping,
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
    )
