"""Each sample's text path, as the engine client runs it: the seam to tokenization.

Owns: the `TextStream` protocol (one sample's detokenizer, stop strings, stop tokens and
budget: tokenization.stream.TextStream implements it) and `text_streams`, the factory the
server builds once from its tokenizer. Receives a request and one sample's sampling;
emits a fresh text stream for that sample.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

from engine.types import SamplingParams
from frontend.request import ActiveRequest


class Detokenizer(Protocol):
    def add(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class TextStep(Protocol):
    @property
    def text(self) -> str: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def stop_reason(self) -> str | int | None: ...


class TextStream(Protocol):
    """One sample's text path (tokenization.TextStream): every rule that ends a sample."""

    tokens: int  # tokens consumed so far

    def add(self, token_id: int, *, last: bool = False, done: bool = False) -> TextStep: ...


TextStreamFactory = Callable[[ActiveRequest, SamplingParams], TextStream]
DetokenizerFactory = Callable[[tuple[int, ...], bool], Detokenizer]  # (prompt ids, skip special)


def text_streams(
    new_detokenizer: DetokenizerFactory, eos_token_ids: Collection[int]
) -> TextStreamFactory:
    """A factory of tokenization.TextStream over `new_detokenizer`, with these EOS ids."""
    from tokenization.stream import TextStream as Stream

    eos = frozenset(eos_token_ids)

    def new(request: ActiveRequest, sampling: SamplingParams) -> TextStream:
        stream: TextStream = Stream(
            new_detokenizer(request.prompt_ids, request.skip_special_tokens),
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            eos_token_ids=() if request.ignore_eos else eos,
            min_tokens=sampling.min_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
        )
        return stream

    return new
