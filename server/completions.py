"""POST /v1/completions: legacy text completions, whole or streamed, in OpenAI's shape.

Choice index = prompt_index * n + sample index (as vLLM). With echo the prompt
text comes first (in the first chunk when streaming) and, with logprobs, the
prompt's logprobs too (the first one null). `max_tokens: 0` with echo returns
only the prompt, as lm-eval's log-likelihood requests expect.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any

from engine.request import Delta
from engine.types import TokenLogprobs
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
        tokenizer: TokenizerClient,
        token_id: int,
        lp: TokenLogprobs | None,
        top_n: int,
        offset: int,
    ) -> None:
        """Append one token that starts at character `offset` of the choice's text."""
        text = tokenizer.token_text(token_id)
        self.tokens.append(text)
        self.text_offset.append(offset)
        if lp is None:
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
        else:
            self.token_logprobs.append(finite(lp.logprob))
            top = {tokenizer.token_text(t): finite(v) for t, v in lp.top[:top_n]}
            top.setdefault(text, finite(lp.logprob))
            self.top_logprobs.append(top)

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
    """Character offset of each token in decoded text: special tokens add nothing, and a
    token that ends inside a multi-byte character starts where that character starts."""

    def __init__(self, tokenizer: TokenizerClient, start: int = 0):
        self._tokenizer = tokenizer
        self._special = tokenizer.special_token_ids
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = start

    def next(self, token_id: int) -> int:
        """The offset of `token_id`, then advance past it."""
        offset = self.chars
        if token_id not in self._special:
            self.chars += len(self._decoder.decode(self._tokenizer.token_bytes(token_id)))
        return offset


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    index: int
    prompt: PromptInput
    text: str = ""
    started: bool = False
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    offsets: TextOffsets | None = None  # of generated tokens, when logprobs are asked


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

    def apply(self, item: PromptDelta) -> dict[str, Any] | None:
        delta = item.delta
        choice = self.states[item.prompt_index * self.plan.n + delta.index]
        piece = CompletionLogprobs() if self.plan.logprobs is not None else None
        new_text = ""
        if not choice.started:
            choice.started = True
            if self.plan.echo:
                new_text += choice.prompt.text
                if piece is not None:
                    self._add_prompt_logprobs(piece, choice, delta)
            start = len(choice.prompt.text) if self.plan.echo else 0
            choice.offsets = TextOffsets(self.tokenizer, start)
        if not self.plan.discard_output:
            if piece is not None and delta.logprobs is not None and choice.offsets is not None:
                for token_id, lp in zip(delta.token_ids, delta.logprobs, strict=True):
                    offset = choice.offsets.next(token_id)
                    piece.add(self.tokenizer, token_id, lp, self.plan.logprobs or 0, offset)
            new_text += delta.text
        if delta.finish_reason is not None:
            choice.finish_reason = "length" if self.plan.discard_output else delta.finish_reason
        choice.text += new_text
        logprobs = None
        if piece is not None:
            if choice.logprobs is None:
                choice.logprobs = CompletionLogprobs()
            choice.logprobs.extend(piece)
            logprobs = piece.as_dict()
        if not (new_text or delta.finish_reason is not None or logprobs):
            return None
        entry = {
            "index": choice.index,
            "text": new_text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
        }
        return self.chunk([entry])

    def _add_prompt_logprobs(
        self, piece: CompletionLogprobs, choice: ChoiceState, delta: Delta
    ) -> None:
        entries = delta.prompt_logprobs or (None,) * len(choice.prompt.ids)
        offsets = TextOffsets(self.tokenizer)
        for token_id, lp in zip(choice.prompt.ids, entries, strict=False):
            piece.add(self.tokenizer, token_id, lp, self.plan.logprobs or 0, offsets.next(token_id))

    def choices(self) -> list[dict[str, Any]]:
        return [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": c.logprobs.as_dict() if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in sorted(self.states.values(), key=lambda c: c.index)
        ]
