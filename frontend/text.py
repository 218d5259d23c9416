"""Each sample's text path, as the output processor runs it: the seam to tokenization.

Owns: the `TextStream` protocol (one sample's detokenizer, stop strings and the release
of held text: tokenization.stream.TextStream implements it) and `text_streams`, the
factory the server builds once from its tokenizer. Receives a request and one sample's
sampling; emits a fresh text stream for that sample. Every token rule (EOS, stop ids,
min_tokens, the budget, grammar completion) is the core's: a text stream is told its
verdict with each token.
"""

from __future__ import annotations

from collections.abc import Callable
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
    """One sample's text path (tokenization.TextStream): stop strings and held text."""

    tokens: int  # tokens consumed so far

    def add(
        self,
        token_id: int,
        *,
        finish: str | None = None,
        done: bool = False,
        stop_token: int | None = None,
    ) -> TextStep: ...


TextStreamFactory = Callable[[ActiveRequest, SamplingParams], TextStream]
DetokenizerFactory = Callable[[tuple[int, ...], bool], Detokenizer]  # (prompt ids, skip special)


def text_streams(new_detokenizer: DetokenizerFactory) -> TextStreamFactory:
    """A factory of tokenization.TextStream over `new_detokenizer`."""
    from tokenization.stream import TextStream as Stream

    def new(request: ActiveRequest, sampling: SamplingParams) -> TextStream:
        stream: TextStream = Stream(
            new_detokenizer(request.prompt_ids, request.skip_special_tokens),
            stop=request.stop,
            include_stop_str_in_output=request.include_stop_str_in_output,
        )
        return stream

    return new
