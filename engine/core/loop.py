"""The engine core's loop: messages in, one step, outputs out, until told to stop.

Runs on: the core process's main thread, the only thread that touches the EngineCore
(scheduler and runner). Owns: the EOS set (the model's and its tokenizer's) and the
grammar compiler of structured outputs (constraints arrive as specs and are compiled
here, where the masks are needed). Receives `AddRequest`, `Abort`, `Stop`,
`LoadLora` and `UnloadLora` (engine.core.messages) from `receive`; emits one `Outputs`
per step that sampled anything, and a `LoraDone` per adapter loaded or unloaded,
through `send`.

Each iteration takes every message waiting (blocking only when nothing runs), dispatches
the next step, then waits for the one dispatched before it and sends its tokens: one step
is in flight while the host plans and sends (`CoreConfig.async_scheduling`; a step that
needs what the one in flight decides is planned after it instead). A request the core
cannot take (its grammar fails to compile, its prompt does not fit, an id is outside
the vocabulary) comes back in `Outputs.rejected`; a failure of the loop itself
propagates (the process reports it and exits non-zero).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Generic, Protocol, TypeVar

from engine.config import ModelConfig
from engine.core.config import CoreConfig
from engine.core.messages import (
    Abort,
    AddRequest,
    FromCore,
    LoadLora,
    LoraDone,
    Outputs,
    Stats,
    Stop,
    ToCore,
    TokenOut,
    UnloadLora,
)
from engine.core.scheduler import Emitted, SequenceState
from engine.faults import InjectedFault
from engine.lora import Adapters
from engine.types import EngineLimits, TokenConstraint, TokenLogprobs

logger = logging.getLogger(__name__)

Receive = Callable[[bool], list[ToCore]]  # block -> the messages waiting (block: >= 1)
Send = Callable[[FromCore], None]
CompileGrammar = Callable[[str, str], TokenConstraint]  # (kind, text) -> constraint


def seq_id(request_id: str, index: int) -> str:
    return f"{index}:{request_id}"


def parse_seq_id(seq: str) -> tuple[str, int]:
    index, _, request_id = seq.partition(":")
    return request_id, int(index)


@dataclass
class LoopCounters:
    steps: int = 0
    ahead: int = 0  # steps dispatched while the one before them was still running


P = TypeVar("P")


class Core(Protocol[P]):
    """What the loop drives: an EngineCore, or a disaggregated pair of them."""

    @property
    def config(self) -> CoreConfig: ...
    @property
    def model_config(self) -> ModelConfig: ...
    @property
    def limits(self) -> EngineLimits: ...
    @property
    def busy(self) -> bool: ...
    def launch(self, ahead: bool = False) -> P | None: ...
    def finish(self, pending: P) -> list[Emitted]: ...
    def add(self, seq: SequenceState) -> None: ...
    def abort(self, seq_id: str) -> bool: ...
    def stats(self, steps: int) -> Stats: ...
    @property
    def adapters(self) -> Adapters | None: ...


class CoreLoop(Generic[P]):
    def __init__(
        self,
        core: Core[P],
        receive: Receive,
        send: Send,
        compile_grammar: CompileGrammar | None = None,
        fail_after_steps: int | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        """`eos_token_ids`: EOS ids besides the model config's (the tokenizer's)."""
        self._core = core
        self.eos_token_ids = frozenset(core.model_config.eos_token_ids) | eos_token_ids
        self._receive = receive
        self._send = send
        self._compile_grammar = compile_grammar
        self._fail_after = fail_after_steps  # test hook: the loop raises after this many steps
        self.counters = LoopCounters()
        self._stopping = False

    def run(self) -> None:
        core = self._core
        ahead = core.config.async_scheduling
        pending: P | None = None  # the step on the devices
        while not self._stopping or pending is not None:
            rejected = []
            idle = pending is None and not core.busy
            messages = [] if self._stopping else self._receive(idle)
            for message in messages:
                why = self._handle(message)
                if why is not None:
                    rejected.append(why)
            # One step in flight: the next is planned and dispatched before the one on the
            # devices is waited for, unless it needs what that one decides.
            following = None
            if not self._stopping and (pending is None or ahead):
                following = core.launch(ahead=pending is not None)
                self.counters.ahead += int(following is not None and pending is not None)
            events = [] if pending is None else core.finish(pending)
            if following is None and pending is not None and not self._stopping:
                following = core.launch()
            pending = following
            if events:
                self.counters.steps += 1
                if self._fail_after is not None and self.counters.steps > self._fail_after:
                    raise InjectedFault(f"fault injected after {self._fail_after} steps")
            if events or messages:  # the gauges change with every message too (aborts)
                tokens = tuple(self._out(e) for e in events)
                self._send(Outputs(tokens, self.stats(), tuple(rejected)))

    def stats(self) -> Stats:
        return self._core.stats(self.counters.steps)

    def _handle(self, message: ToCore) -> tuple[str, str] | None:
        if isinstance(message, Stop):
            self._stopping = True
        elif isinstance(message, Abort):
            for request_id, index in message.samples:
                self._core.abort(seq_id(request_id, index))
        elif isinstance(message, LoadLora | UnloadLora):
            self._send(self._lora(message))
        elif isinstance(message, AddRequest):
            try:
                self._add(message)
            except ValueError as exc:  # this request's data; the core goes on
                return message.request_id, str(exc)
        return None

    def _lora(self, message: LoadLora | UnloadLora) -> LoraDone:
        """Load or unload an adapter between steps (a load reads its folder here: the
        steps wait for it, as vLLM's do)."""
        adapters, loading = self._core.adapters, isinstance(message, LoadLora)
        try:
            if adapters is None:
                raise ValueError("LoRA adapters are not enabled (--enable-lora)")
            if isinstance(message, LoadLora):
                adapters.load(message.name, message.path)
            else:
                adapters.unload(message.name)
        except ValueError as exc:  # the adapter's files or name; the core goes on
            return LoraDone(message.name, loading, str(exc))
        return LoraDone(message.name, loading)

    def _add(self, request: AddRequest) -> None:
        """The request's sequences, or ValueError (a rejection: 400) when its prompt does
        not fit, an id is outside the vocabulary or its grammar does not compile: where
        these are enforced (the server checked them first, to answer early)."""
        max_tokens = self._core.limits.check(len(request.prompt), request.max_tokens)
        constraint = None
        if request.grammar is not None:
            if self._compile_grammar is None:
                raise ValueError("structured outputs are not available on this engine")
            constraint = self._compile_grammar(request.grammar.kind, request.grammar.text)
        stop = frozenset(request.stop_token_ids)
        eos = frozenset() if request.ignore_eos else self.eos_token_ids
        adapters = self._core.adapters
        if adapters is None and request.lora:
            raise ValueError(f"The model `{request.lora}` does not exist.")
        adapter = 0 if adapters is None else adapters.resolve(request.lora)
        seqs = []
        for index, sample in enumerate(request.samples):
            sampling = sample.params()
            if constraint is not None:
                sampling = replace(sampling, constraint=constraint)
            sampling.check_vocab(self._core.model_config.vocab_size)
            seqs.append(
                SequenceState(
                    seq_id(request.request_id, index),
                    request.prompt,
                    sampling,
                    max_tokens,
                    stop_token_ids=stop,
                    eos_token_ids=eos,
                    prompt_logprobs=request.prompt_logprobs,
                    adapter=adapter,
                )
            )
        for seq in seqs:
            self._core.add(seq)

    def _out(self, event: Emitted) -> TokenOut:
        request_id, index = parse_seq_id(event.seq_id)
        prompt = None
        if event.prompt_logprobs is not None:
            prompt = tuple(_entry(e) for e in event.prompt_logprobs)
        return TokenOut(
            request_id=request_id,
            index=index,
            token=event.token,
            logprob=event.logprob,
            top=event.top,
            finish=event.finish_reason,
            done=event.done,
            error=event.error,
            cached_tokens=event.cached_tokens,
            prompt_logprobs=prompt,
            scheduled=event.scheduled or 0.0,
            stop_reason=event.stop_reason,
        )


def _entry(
    entry: TokenLogprobs | None,
) -> tuple[int, float, tuple[tuple[int, float], ...]] | None:
    return None if entry is None else (entry.token_id, entry.logprob, entry.top)
