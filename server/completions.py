"""POST /v1/completions: legacy text completions, whole or streamed, in OpenAI's shape.

Choice index = prompt_index * n + sample index (as vLLM). With echo the prompt
text comes first (in the first chunk when streaming) and, with logprobs, the
prompt's logprobs too (the first one null). `max_tokens: 0` with echo returns
only the prompt, as lm-eval's log-likelihood requests expect.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.request import Delta
from engine.types import TokenLogprobs
from server.errors import APIError
from server.exchange import Exchange
from server.generation import failure_error
from server.params import GenerationPlan, PromptInput, TokenizerLike, finite
from server.streaming import DONE, encode_event, error_event


@dataclass
class CompletionLogprobs:
    """OpenAI's legacy logprobs object, built token by token."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(
        self,
        tokenizer: TokenizerLike,
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

    def __init__(self, tokenizer: TokenizerLike, start: int = 0):
        self._tokenizer = tokenizer
        self._special = getattr(tokenizer, "special_token_ids", frozenset())
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


class CompletionShaper:
    """Turns deltas into choices and chunks; pure apart from the tokenizer's lookups."""

    def __init__(
        self, plan: GenerationPlan, tokenizer: TokenizerLike, model: str, response_id: str
    ):
        self.plan = plan
        self.tokenizer = tokenizer
        self.model = model
        self.id = response_id
        self.created = int(time.time())
        self.choices = {
            p * plan.n + k: ChoiceState(index=p * plan.n + k, prompt=prompt)
            for p, prompt in enumerate(plan.prompts)
            for k in range(plan.n)
        }

    def apply(self, prompt_index: int, delta: Delta) -> tuple[ChoiceState, str, Any]:
        """Fold a delta into its choice; returns (choice, new text, new logprobs dict or None)."""
        choice = self.choices[prompt_index * self.plan.n + delta.index]
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
        if piece is not None:
            if choice.logprobs is None:
                choice.logprobs = CompletionLogprobs()
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(choice.logprobs, name).extend(getattr(piece, name))
        return choice, new_text, piece.as_dict() if piece is not None else None

    def _add_prompt_logprobs(
        self, piece: CompletionLogprobs, choice: ChoiceState, delta: Delta
    ) -> None:
        entries = delta.prompt_logprobs or (None,) * len(choice.prompt.ids)
        offsets = TextOffsets(self.tokenizer)
        for token_id, lp in zip(choice.prompt.ids, entries, strict=False):
            piece.add(self.tokenizer, token_id, lp, self.plan.logprobs or 0, offsets.next(token_id))

    def usage(self, completion_tokens: int) -> dict[str, int]:
        prompt_tokens = sum(len(p.ids) for p in self.plan.prompts)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def chunk(self, choice: ChoiceState, text: str, logprobs: Any, finish: str | None) -> dict:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            ],
        }
        if self.plan.include_usage:
            body["usage"] = None
        return body

    def response(self, completion_tokens: int) -> dict[str, Any]:
        choices = [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": c.logprobs.as_dict() if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in sorted(self.choices.values(), key=lambda c: c.index)
        ]
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(completion_tokens),
        }


async def complete(exchange: Exchange, shaper: CompletionShaper) -> dict[str, Any]:
    """Collect a whole response (non-streaming)."""
    try:
        async for item in exchange.deltas():
            shaper.apply(item.prompt_index, item.delta)
    except APIError:
        raise
    except Exception as exc:
        raise failure_error(exc) from exc
    return shaper.response(exchange.log.completion_tokens)


async def stream(exchange: Exchange, shaper: CompletionShaper) -> AsyncIterator[bytes]:
    """SSE chunks, then the usage chunk when asked, then [DONE]; errors as an event."""
    try:
        async for item in exchange.deltas():
            choice, text, logprobs = shaper.apply(item.prompt_index, item.delta)
            finish = item.delta.finish_reason
            if text or finish is not None or logprobs:
                yield encode_event(shaper.chunk(choice, text, logprobs, choice.finish_reason))
        if shaper.plan.include_usage:
            usage = shaper.usage(exchange.log.completion_tokens)
            yield encode_event(
                {
                    "id": shaper.id,
                    "object": "text_completion",
                    "created": shaper.created,
                    "model": shaper.model,
                    "choices": [],
                    "usage": usage,
                }
            )
    except Exception as exc:
        error = exc if isinstance(exc, APIError) else failure_error(exc)
        yield error_event(error)
    finally:
        await exchange.close()
    yield DONE
