"""A request's whole text path: detokenizer, then stop strings, then stop tokens.

Runs on: the orchestrator's detokenize stage, one instance per request (per choice).
Owns: the request's IncrementalDetokenizer and StopMatcher.
A stop token (EOS unless ignore_eos, and the user's stop_token_ids) ends the request
without its own text; held-back text is still released, and a stop string completed
by that release wins since it comes first in the text.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from tokenization.detokenizer import IncrementalDetokenizer
from tokenization.stop import StopMatcher
from tokenization.tokenizer import Tokenizer


@dataclass(frozen=True)
class TextStep:
    """Text to send after one token, and why the request stopped, if it did."""

    text: str
    stop_str: str | None = None
    stop_token: int | None = None

    @property
    def finished(self) -> bool:
        return self.stop_str is not None or self.stop_token is not None


class TextStream:
    """Token ids in, client text out, for one generated sequence."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        stop: Sequence[str] = (),
        stop_token_ids: Collection[int] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens
        )
        self._matcher = StopMatcher(stop, include_stop_str_in_output=include_stop_str_in_output)
        self._stop_token_ids = frozenset(stop_token_ids)
        self._finished = False

    @property
    def finished(self) -> bool:
        return self._finished

    def add(self, token_id: int) -> TextStep:
        """Consume one generated token; after a finished step, later tokens yield nothing."""
        if self._finished:
            return TextStep("")
        if token_id in self._stop_token_ids:
            step = self._stop_string_step(self._detokenizer.flush())
            if step.finished:
                return step
            self._finished = True
            return TextStep(step.text + self._matcher.flush(), stop_token=token_id)
        return self._stop_string_step(self._detokenizer.add(token_id))

    def finish(self) -> TextStep:
        """End for another reason (max_tokens, abort): release everything still held."""
        if self._finished:
            return TextStep("")
        step = self._stop_string_step(self._detokenizer.flush())
        if step.finished:
            return step
        self._finished = True
        return TextStep(step.text + self._matcher.flush())

    def _stop_string_step(self, delta: str) -> TextStep:
        result = self._matcher.feed(delta)
        if result.matched is not None:
            self._finished = True
        return TextStep(result.text, stop_str=result.matched)
