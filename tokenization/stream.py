"""A sample's text path: incremental detokenizing, stop strings, release of held text.

Runs on: the HTTP process's output processor (frontend.output), one instance per sample
(the property tests drive the same class). Owns: the sample's detokenizer and stop
matcher and its token count. Every token rule is the engine core's
(engine.core.rules.finish_reason: EOS, stop token ids after min_tokens, the budget;
and grammar completion), and each token comes with its verdict: a stop token (or EOS)
ends the sample without its own text; any other token's text goes through the stop
strings, which may end the sample first; a token that completes the grammar ends it
with "stop", the last of the budget with "length", each after its text. Whatever ends
it, held-back text is released, and a stop string completed by that release wins,
since it comes first in the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenization.detokenizer import IncrementalDetokenizer
from tokenization.stop import StopMatcher
from tokenization.tokenizer import Tokenizer


class Detokenizer(Protocol):
    def add(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


@dataclass(frozen=True)
class TextStep:
    """Text to send after one token, and why the sample ended, if it did."""

    text: str
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: str | int | None = None  # the stop string or stop token id; None for EOS

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_str(self) -> str | None:
        return self.stop_reason if isinstance(self.stop_reason, str) else None

    @property
    def stop_token(self) -> int | None:
        return self.stop_reason if isinstance(self.stop_reason, int) else None


class TextStream:
    """Token ids in, client text out, for one generated sequence."""

    def __init__(
        self,
        detokenizer: Detokenizer,
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._detokenizer = detokenizer
        self._matcher = (
            StopMatcher(stop, include_stop_str_in_output=include_stop_str_in_output)
            if stop
            else None
        )
        self._finished = False
        self.tokens = 0  # tokens consumed (the sample's completion_tokens)

    @classmethod
    def of(
        cls,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        **rules: object,
    ) -> TextStream:
        """A stream over the real incremental detokenizer of `tokenizer`."""
        detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens
        )
        return cls(detokenizer, **rules)  # type: ignore[arg-type]

    @property
    def finished(self) -> bool:
        return self._finished

    def add(
        self,
        token_id: int,
        *,
        finish: str | None = None,
        done: bool = False,
        stop_token: int | None = None,
    ) -> TextStep:
        """Consume one generated token with the core's verdict on it: `finish` "length"
        (the budget ends with it), "stop" with `done` (the grammar is complete with it), or
        "stop" without (a stop token: `stop_token` its id, None for EOS; its text is not
        sent); None: the sample goes on, unless a stop string ends it here.

        After a finished step, later tokens yield nothing.
        """
        if self._finished:
            return TextStep("")
        self.tokens += 1
        if finish == "stop" and not done:
            return self._end("stop", stop_token)
        step = self._stop_strings(self._detokenizer.add(token_id))
        if step.finished or finish is None:
            return step
        tail = self._end(finish, None)
        return TextStep(step.text + tail.text, tail.finish_reason, tail.stop_reason)

    def finish(self) -> TextStep:
        """End for another reason (the budget ran out without `last`): release what is held."""
        if self._finished:
            return TextStep("")
        return self._end("length", None)

    def _end(self, reason: str, stop_reason: str | int | None) -> TextStep:
        """Release held-back text; a stop string it completes is the reason instead."""
        step = self._stop_strings(self._detokenizer.flush())
        if step.finished:
            return step
        self._finished = True
        held = self._matcher.flush() if self._matcher is not None else ""
        return TextStep(step.text + held, reason, stop_reason)

    def _stop_strings(self, delta: str) -> TextStep:
        if self._matcher is None:
            return TextStep(delta)
        result = self._matcher.feed(delta)
        if result.matched is None:
            return TextStep(result.text)
        self._finished = True
        return TextStep(result.text, "stop", result.matched)
