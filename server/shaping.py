"""What every endpoint's response shares: the envelope, usage, and the usage chunk.

Completions and chat subclass `ResponseShaper` with only their own choice formats; the
`Generation` drives either through the same four calls (opening, apply,
usage_chunk, response).
"""

from __future__ import annotations

import time
from typing import Any

from server.backend import TokenizerClient
from server.generation import PromptDelta
from server.params import GenerationPlan


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

    def new_states(self, plan: GenerationPlan) -> dict[int, Any]:
        """Each choice's state, by choice index."""
        raise NotImplementedError

    def opening(self) -> list[dict[str, Any]]:
        """Chunks streamed before any token."""
        return []

    def apply(self, item: PromptDelta) -> dict[str, Any] | None:
        """Fold a delta into the response; the chunk to stream for it, if any."""
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

    def usage(self, completion_tokens: int) -> dict[str, int]:
        prompt_tokens = sum(len(p.ids) for p in self.plan.prompts)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
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
