"""What the server needs of the model behind it, and nothing more: the seams to frontend/.

The HTTP side speaks to a loaded model only through these protocols (the real
engine client and tokenizer implement them, and so do the tests' fakes), so no
handler reaches past them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.types import EngineLimits, EngineStats
from frontend.request import ActiveRequest, RequestStream
from tokenization.grammar import GrammarCompiler


class TokenizerClient(Protocol):
    """The tokenizer operations the server uses (tokenization.Tokenizer implements them)."""

    vocab_size: int
    special_token_ids: frozenset[int]

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def validate_ids(self, ids: Sequence[int]) -> list[int]: ...

    def token_text(self, token_id: int) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's configuration (vLLM's /tokenizer_info)."""
        ...

    def grammar_compiler(self, vocab_size: int) -> GrammarCompiler:
        """Structured outputs' compiler for this tokenizer and the model's vocabulary."""
        ...

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]: ...


class EngineHandle(Protocol):
    """The engine operations the runtime and the request handlers use (frontend.client)."""

    @property
    def alive(self) -> bool: ...

    def submit(self, request: ActiveRequest) -> RequestStream: ...

    def abort(self, request_id: str) -> None: ...

    def drain(self, timeout: float) -> bool: ...

    def stop(self) -> None: ...

    def stats(self) -> EngineStats: ...

    def add_failure_listener(self, listener: Callable[[BaseException], None]) -> None: ...


ModelLimits = EngineLimits  # the engine publishes them; the server only asks


@dataclass(frozen=True)
class Backend:
    """A loaded, warmed-up model behind a started engine."""

    tokenizer: TokenizerClient
    engine: EngineHandle
    limits: ModelLimits
    eos_token_ids: frozenset[int] = frozenset()  # the tokens the engine ends a sample on
