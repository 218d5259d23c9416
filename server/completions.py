"""POST /v1/completions: legacy text completions, whole or streamed, in OpenAI's shape.

Choice index = prompt_index * n + sample index (as vLLM). With echo the prompt
text comes first (in the first chunk when streaming) and, with logprobs, the
prompt's logprobs too (the first one null). `max_tokens: 0` with echo returns
only the prompt, as lm-eval's log-likelihood requests expect; a token-id prompt echoes
as its decoded text, special tokens included, as vLLM's does. vLLM's extras in
each choice: `stop_reason` (the stop string or token id that ended it),
`prompt_logprobs`, and with `return_token_ids` the `prompt_token_ids` (a stream's
first chunk of the choice) and `token_ids` (each chunk's own).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.types import TokenLogprobs
from frontend.request import Delta
from server.backend import TokenizerClient
from server.generation import PromptDelta
from server.params import GenerationPlan, PromptInput, finite
from server.shaping import ResponseShaper


@dataclass
class CompletionLogprobs:
    """OpenAI's legacy logprobs object, built token by token."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(
        self,
        name: Callable[[int], str],
        token_id: int,
        lp: TokenLogprobs | None,
        top: Sequence[tuple[int, float]],
        offset: int,
    ) -> None:
        """Append one token that starts at character `offset` of the choice's text, with
        its alternatives `top`; `name` gives a token's name in the object (its text, or
        "token_id:N")."""
        text = name(token_id)
        self.tokens.append(text)
        self.text_offset.append(offset)
        if lp is None:
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
        else:
            self.token_logprobs.append(finite(lp.logprob))
            named = {text: finite(lp.logprob)}  # the token first, then the others (vLLM's)
            for t, v in top:
                named.setdefault(name(t), finite(v))
            self.top_logprobs.append(named)

    def extend(self, other: CompletionLogprobs) -> None:
        self.tokens.extend(other.tokens)
        self.token_logprobs.extend(other.token_logprobs)
        self.top_logprobs.extend(other.top_logprobs)
        self.text_offset.extend(other.text_offset)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


class TextOffsets:
    """Character offset of each token in decoded text: special tokens add nothing (or their
    text, where the text shows them: `specials`), and a token that ends inside a
    multi-byte character starts where that character starts."""

    def __init__(self, tokenizer: TokenizerClient, start: int = 0, specials: bool = False):
        self._tokenizer = tokenizer
        self._special = tokenizer.special_token_ids
        self._specials_shown = specials
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = start

    def next(self, token_id: int) -> int:
        """The offset of `token_id`, then advance past it."""
        offset = self.chars
        if token_id not in self._special:
            self.chars += len(self._decoder.decode(self._tokenizer.token_bytes(token_id)))
        elif self._specials_shown:
            self.chars += len(self._tokenizer.token_text(token_id))
        return offset


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    index: int
    prompt: PromptInput
    text: str = ""
    started: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: CompletionLogprobs | None = None
    offsets: TextOffsets | None = None  # of generated tokens, when logprobs are asked
    token_ids: list[int] = field(default_factory=list)  # generated (return_token_ids)
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's field


class CompletionShaper(ResponseShaper):
    """Turns deltas into choices and chunks; pure apart from the tokenizer's lookups."""

    object_name = "text_completion"
    chunk_object = "text_completion"

    def new_states(self, plan: GenerationPlan) -> dict[int, ChoiceState]:
        """Choice index = prompt_index * n + sample index, as vLLM numbers them."""
        return {
            p * plan.n + k: ChoiceState(index=p * plan.n + k, prompt=prompt)
            for p, prompt in enumerate(plan.prompts)
            for k in range(plan.n)
        }

    def fold(self, item: PromptDelta) -> dict[str, Any] | None:
        delta = item.delta
        choice = self.states[item.prompt_index * self.plan.n + delta.index]
        piece = CompletionLogprobs() if self.plan.logprobs is not None else None
        new_text = ""
        first = not choice.started
        if first:
            choice.started = True
            choice.prompt_logprobs = self.prompt_logprobs(delta.prompt_logprobs)
            if self.plan.echo:
                new_text += choice.prompt.text
                if piece is not None:
                    self._add_prompt_logprobs(piece, choice, delta)
            start = len(choice.prompt.text) if self.plan.echo else 0
            choice.offsets = TextOffsets(self.tokenizer, start)
        new_ids: tuple[int, ...] = ()
        if not self.plan.discard_output:
            if piece is not None and delta.logprobs is not None and choice.offsets is not None:
                for token_id, lp in zip(delta.token_ids, delta.logprobs, strict=True):
                    offset = choice.offsets.next(token_id)
                    top = self.plan.alternatives(lp)
                    piece.add(self.token_text, token_id, lp, top, offset)
            new_text += delta.text
            new_ids = delta.token_ids
            choice.token_ids += new_ids
        if delta.finish_reason is not None:
            choice.finish_reason = "length" if self.plan.discard_output else delta.finish_reason
            choice.stop_reason = None if self.plan.discard_output else delta.stop_reason
        choice.text += new_text
        logprobs = None
        if piece is not None:
            if choice.logprobs is None:
                choice.logprobs = CompletionLogprobs()
            choice.logprobs.extend(piece)
            logprobs = piece.as_dict()
        with_ids = self.plan.return_token_ids
        if not (new_text or delta.finish_reason is not None or logprobs or with_ids and new_ids):
            return None
        entry: dict[str, Any] = {
            "index": choice.index,
            "text": new_text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if with_ids:
            if first:
                entry["prompt_token_ids"] = list(choice.prompt.ids)
            entry["token_ids"] = list(new_ids)
        return self.chunk([entry])

    def _add_prompt_logprobs(
        self, piece: CompletionLogprobs, choice: ChoiceState, delta: Delta
    ) -> None:
        entries = delta.prompt_logprobs or (None,) * len(choice.prompt.ids)
        offsets = TextOffsets(self.tokenizer, specials=choice.prompt.specials_shown)
        top_n = self.plan.logprobs or 0
        for token_id, lp in zip(choice.prompt.ids, entries, strict=False):
            top = lp.top[:top_n] if lp is not None else ()
            piece.add(self.token_text, token_id, lp, top, offsets.next(token_id))

    def choices(self) -> list[dict[str, Any]]:
        """Each choice, with vLLM's extra fields null unless asked (as vLLM's bodies)."""
        with_ids = self.plan.return_token_ids
        return [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": c.logprobs.as_dict() if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "prompt_logprobs": c.prompt_logprobs,
                "prompt_token_ids": list(c.prompt.ids) if with_ids else None,
                "token_ids": c.token_ids if with_ids else None,
            }
            for c in sorted(self.states.values(), key=lambda c: c.index)
        ]
