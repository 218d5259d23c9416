"""What every endpoint's response shares: the envelope, usage, and the usage chunk.

Completions and chat subclass `ResponseShaper` with only their own choice formats
(`fold`); the `Generation` drives either through the same four calls (opening, apply,
usage_chunk, response). `apply` keeps what usage needs of every delta: each choice's
tokens so far (vLLM's continuous_usage_stats puts them on every chunk) and each
prompt's positions taken from the engine's prefix cache
(`usage.prompt_tokens_details.cached_tokens`). vLLM's prompt logprobs and
"token_id:N" tokens are rendered here for both.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from engine.types import TokenLogprobs
from server.backend import TokenizerClient
from server.generation import PromptDelta
from server.params import GenerationPlan, finite


class ResponseShaper:
    """One response's envelope; subclasses fold deltas into choices."""

    object_name = ""  # the whole body's "object"
    chunk_object = ""  # each streamed chunk's "object"

    def __init__(
        self, plan: GenerationPlan, tokenizer: TokenizerClient, model: str, response_id: str
    ):
        self.plan = plan
        self.tokenizer = tokenizer
        self.model = model
        self.id = response_id
        self.created = int(time.time())
        self.states = self.new_states(plan)
        self.cached: dict[int, int] = {}  # prompt index -> positions from the prefix cache

    def new_states(self, plan: GenerationPlan) -> dict[int, Any]:
        """Each choice's state, by choice index."""
        raise NotImplementedError

    def opening(self) -> list[dict[str, Any]]:
        """Chunks streamed before any token."""
        return []

    def apply(self, item: PromptDelta) -> dict[str, Any] | None:
        """Fold a delta into the response; the chunk to stream for it, if any."""
        delta = item.delta
        self.cached[item.prompt_index] = max(
            self.cached.get(item.prompt_index, 0), delta.cached_tokens
        )
        chunk = self.fold(item)
        if chunk is not None and self.plan.continuous_usage:
            done = 0 if self.plan.discard_output else delta.completion_tokens
            chunk["usage"] = self.prompt_usage(item.prompt_index, done)
        return chunk

    def fold(self, item: PromptDelta) -> dict[str, Any] | None:
        """The endpoint's part of `apply`."""
        raise NotImplementedError

    def choices(self) -> list[dict[str, Any]]:
        """The whole body's choices, in index order."""
        raise NotImplementedError

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.plan.include_usage:
            body["usage"] = None
        return body

    def prompt_usage(self, prompt_index: int, completion_tokens: int) -> dict[str, int]:
        """One choice's usage so far (a continuous_usage_stats chunk's)."""
        prompt_tokens = len(self.plan.prompts[prompt_index].ids)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        prompt_tokens = sum(len(p.ids) for p in self.plan.prompts)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())},
        }

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        return self.chunk([]) | {"usage": self.usage(completion_tokens)}

    def response(self, completion_tokens: int) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": self.choices(),
            "usage": self.usage(completion_tokens),
        }

    def token_text(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or vLLM's "token_id:N" when asked."""
        if self.plan.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.token_text(token_id)

    def prompt_logprobs(
        self, entries: Sequence[TokenLogprobs | None] | None
    ) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's prompt_logprobs: per prompt position (the first None), the prompt token
        and the top k alternatives by id, each {logprob, rank, decoded_token}; a rank is
        null where the engine's top k do not hold the token."""
        k = self.plan.prompt_logprobs
        if k is None or entries is None:
            return None
        out: list[dict[str, dict[str, Any]] | None] = []
        for lp in entries:
            if lp is None:
                out.append(None)
                continue
            top = lp.top[:k]
            ranks = {token: rank for rank, (token, _) in enumerate(top, start=1)}
            position = {str(lp.token_id): self._logprob(lp.token_id, lp.logprob, ranks)}
            for token, logprob in top:
                position.setdefault(str(token), self._logprob(token, logprob, ranks))
            out.append(position)
        return out

    def _logprob(self, token_id: int, logprob: float, ranks: dict[int, int]) -> dict[str, Any]:
        return {
            "logprob": finite(logprob),
            "rank": ranks.get(token_id),
            "decoded_token": self.tokenizer.token_text(token_id),
        }
