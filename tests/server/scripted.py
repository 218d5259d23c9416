"""A backend whose engine answers from a script: exact deltas, then an end or a failure.

The tokenizer is the tiny checkpoint's real one, recording the thread each call
runs on, so a test can check what ran off the event loop; no JAX is involved, so a
server over it starts at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.types import EngineStats
from frontend.request import ActiveRequest, Delta, RequestFailed, RequestStream
from server.backend import Backend, ModelLimits
from tokenization import Tokenizer

# A Hermes-style template: the tools, earlier calls (arguments as objects) and tool replies.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\nTools:{% for tool in tools %} "
    "{{ tool.function.name }}{{ (tool.function.parameters or {}) | tojson }}{% endfor %}"
    "{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}<|{{ message.role }}|>\n"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}"
    "{% elif message.role == 'tool' %}[{{ message.tool_call_id }}] {{ message.content }}"
    "{% else %}{{ message.content }}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if reasoning_effort is defined %}<|effort|>{{ reasoning_effort }}\n{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class RecordingTokenizer(Tokenizer):
    """The real tokenizer; `threads` holds the name of the thread of each call."""

    threads: list[str]

    def _record(self) -> None:
        self.threads.append(threading.current_thread().name)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self._record()
        return super().encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Any, *, skip_special_tokens: bool = True) -> str:
        self._record()
        return super().decode(ids, skip_special_tokens=skip_special_tokens)


@dataclass
class ScriptedEngine:
    """Each request gets `script` (sample 0's deltas), then ends, or fails with `failure`;
    with `hold` it stays open after the script (until aborted, which it only records)."""

    script: list[Delta] = field(default_factory=list)
    failure: RequestFailed | None = None
    hold: bool = False
    submitted: list[ActiveRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    alive: bool = True

    def submit(self, request: ActiveRequest) -> RequestStream:
        self.submitted.append(request)
        stream = RequestStream(request.request_id, request.n)
        for delta in self.script:
            stream.push(delta)
        if not self.hold:
            stream.close(error=self.failure)
        return stream

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def drain(self, timeout: float) -> bool:
        return True

    def stop(self) -> None:
        self.alive = False

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0, 1, alive=self.alive, draining=False)

    def add_failure_listener(self, listener: Callable[[BaseException], None]) -> None:
        pass


def delta(text: str, tokens: int, finish_reason: str | None = None) -> Delta:
    """A delta of sample 0; `tokens` is its cumulative completion token count."""
    return Delta(
        index=0,
        text=text,
        token_ids=(5,),
        logprobs=None,
        finish_reason=finish_reason,
        stop_reason=None,
        prompt_tokens=0,
        completion_tokens=tokens,
    )


def scripted_backend(
    checkpoint: Path,
    engine: ScriptedEngine,
    *,
    chat_template: str | None = None,
    max_model_len: int = 128,
) -> tuple[Backend, RecordingTokenizer]:
    """The checkpoint's tokenizer (or its own chat template) over `engine`."""
    tokenizer = RecordingTokenizer.from_folder(checkpoint, chat_template=chat_template)
    tokenizer.threads = []
    limits = ModelLimits(
        max_model_len=max_model_len,
        max_prompt_len=max_model_len // 2,
        vocab_size=tokenizer.vocab_size,
    )
    return Backend(tokenizer=tokenizer, engine=engine, limits=limits), tokenizer
