"""A sample's whole text path, and every rule that ends it.

Runs on: the orchestrator's detokenize stage, one instance per sample (the
property tests drive the same class). Owns: the sample's detokenizer and stop
matcher, its token count and the finishing rules, in this order per token:
a stop token id (the user's, once min_tokens are out) or EOS (unless
ignore_eos; the model's, likewise after min_tokens) ends the sample without
its own text; else the token's text goes through the stop strings; a token that
completes the sample's structured-output grammar ends it with "stop"; the last
token of the budget ends it with "length". Whatever ends it, held-back text is
released, and a stop string completed by that release wins, since it comes
first in the text.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
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
        stop_token_ids: Collection[int] = (),
        eos_token_ids: Collection[int] = (),
        min_tokens: int = 0,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._detokenizer = detokenizer
        self._matcher = (
            StopMatcher(stop, include_stop_str_in_output=include_stop_str_in_output)
            if stop
            else None
        )
        self._stop_token_ids = frozenset(stop_token_ids)
        self._eos_token_ids = frozenset(eos_token_ids)
        self._min_tokens = min_tokens
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

    def add(self, token_id: int, *, last: bool = False, done: bool = False) -> TextStep:
        """Consume one generated token; `last`: the budget (max_tokens, context) ends with it;
        `done`: the structured-output grammar is complete with it (nothing may follow).

        After a finished step, later tokens yield nothing.
        """
        if self._finished:
            return TextStep("")
        self.tokens += 1
        may_stop = self.tokens >= self._min_tokens
        if may_stop and token_id in self._stop_token_ids:
            return self._end("stop", token_id)
        if may_stop and token_id in self._eos_token_ids:
            return self._end("stop", None)
        step = self._stop_strings(self._detokenizer.add(token_id))
        if step.finished or not (last or done):
            return step
        tail = self._end("stop" if done else "length", None)
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
