"""The HTTP process's side of the engine core: requests out, ordered text deltas back.

Runs on: the callers' threads (submit, abort, drain, stats: any thread), one receiver
thread (reads the core's outputs, runs each sample's text stream, pushes Deltas) and
one watcher thread (waits on the core process). Owns: the core process and the
sockets to it, the open requests (their streams, seeds, text streams and samples not
yet ended), the admission bound and the lifecycle (starting, running, draining,
stopped, dead). Receives ActiveRequests; emits Deltas into each RequestStream, every
token of a sample on this one path, in order (DESIGN: the JetStream lesson).

Token rules the core owns (EOS and stop token ids after min_tokens, the token budget,
grammars); the text rules (stop strings) are the text stream's here, and a sample they
end is aborted in the core. If the core dies, every open request fails at once, health
turns false (`alive`) and the failure listeners run (the server exits non-zero).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from engine.core.messages import (
    Abort,
    AddRequest,
    Failed,
    FromCore,
    Grammar,
    Log,
    Outputs,
    Ready,
    Sample,
    Stats,
    Stop,
    ToCore,
    TokenOut,
    decode_from_core,
    encode,
)
from engine.core.process import ProcessConfig
from engine.lora_requests import LoraDone, LoraRequests
from engine.request import (
    ActiveRequest,
    Delta,
    Overloaded,
    RequestFailed,
    RequestRejected,
    RequestStream,
    Unavailable,
    Wakeups,
    sample_samplings,
)
from engine.text import TextStream, TextStreamFactory
from engine.types import EngineLimits, EngineStats, SamplingParams, TokenLogprobs

logger = logging.getLogger(__name__)

_STOP_S = 15.0  # a stopping core gets this long to exit before it is killed
_RATE_WINDOW = 64  # samples whose end times estimate the service rate for Retry-After
_MAX_RETRY_AFTER_S = 60.0


@dataclass
class _Open:
    """One request between submit and its last delta; touched under the client's lock
    (submit, abort) or by the receiver thread."""

    request: ActiveRequest
    stream: RequestStream
    samplings: tuple[SamplingParams, ...]
    texts: dict[int, TextStream] = field(default_factory=dict)
    live: set[int] = field(default_factory=set)  # samples not yet ended
    started: set[int] = field(default_factory=set)  # samples that have a first token


class EngineClient:
    """Starts the engine core's process and serves ActiveRequests through it."""

    def __init__(
        self,
        core: dict[str, object],
        text_streams: TextStreamFactory,
        eos_token_ids: Collection[int],
        *,
        max_queued_samples: int = 256,
        log_level: int = logging.INFO,
        compile_cache_dir: str | None = None,
        fail_after_steps: int | None = None,
        num_processes: int = 1,
        coordinator_address: str | None = None,
        distributed_timeout: float = 300.0,
        prefill_devices: str | None = None,
        generate_devices: str | None = None,
    ) -> None:
        self._text_streams = text_streams
        self._eos = frozenset(eos_token_ids)
        self._max_queued = max_queued_samples
        self._folder = tempfile.TemporaryDirectory(prefix="engine-core-")
        base = Path(self._folder.name)
        self._config = ProcessConfig(
            core=core,
            requests_address=f"ipc://{base / 'requests'}",
            outputs_address=f"ipc://{base / 'outputs'}",
            log_level=log_level,
            compile_cache_dir=compile_cache_dir,
            fail_after_steps=fail_after_steps,
            num_processes=num_processes,  # multi-host: the core leads (engine.multihost)
            coordinator_address=coordinator_address,
            distributed_timeout=distributed_timeout,
            prefill_devices=prefill_devices,  # disaggregated (engine.core.disaggregated)
            generate_devices=generate_devices,
        )
        self._context = zmq.Context()
        self._requests = self._context.socket(zmq.PUSH)
        self._requests.setsockopt(zmq.LINGER, 0)
        self._requests.bind(self._config.requests_address)
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.bind(self._config.outputs_address)
        self._send_lock = threading.Lock()  # ZMQ sockets are not thread-safe
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._open: dict[str, _Open] = {}
        self._waiting = 0  # samples submitted that have no first token yet
        self._sample_ends: deque[float] = deque(maxlen=_RATE_WINDOW)
        self._ready = threading.Event()
        self._dead = threading.Event()
        self._error: BaseException | None = None
        self._listeners: list[Callable[[BaseException], None]] = []
        self._draining = False
        self._stopping = False
        self._stats = Stats(0, 0, 1, 1, 0, 0, 0, 0, 0)
        self.info: Ready | None = None
        self.limits = EngineLimits(2, 1, 1)  # replaced by the core's on Ready
        self._process: subprocess.Popen[bytes] | None = None
        self._threads: list[threading.Thread] = []
        self.loras = LoraRequests(self._send, self.add_failure_listener)  # (server.lora)

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> Ready:
        """Start the core process and wait until it has warmed up (or failed)."""
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._process = subprocess.Popen(  # stdin: the core's lifeline (engine.core.process)
            [sys.executable, "-m", "engine.core.process", self._config.to_json()],
            env=env,
            stdin=subprocess.PIPE,
        )
        for target, name in ((self._receive, "engine-client"), (self._watch, "engine-watch")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            self._threads.append(thread)
            thread.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if self._dead.is_set():
                raise RuntimeError(f"the engine core failed to start: {self._error}")
            if deadline is not None and time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the engine core was not ready in {timeout} s")
        assert self.info is not None
        return self.info

    @property
    def alive(self) -> bool:
        return self._ready.is_set() and self._error is None and not self._dead.is_set()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def add_failure_listener(self, listener: Callable[[BaseException], None]) -> None:
        with self._lock:
            if self._error is None:
                self._listeners.append(listener)
                return
            error = self._error
        listener(error)

    def wait_dead(self, timeout: float | None = None) -> bool:
        return self._dead.wait(timeout)

    def drain(self, timeout: float) -> bool:
        """Refuse new requests, let open ones finish for up to `timeout` s, then stop."""
        deadline = time.monotonic() + timeout
        with self._idle:
            self._draining = True
            while self._open and not self._dead.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._idle.wait(min(remaining, 0.1))
            drained = not self._open and self._error is None
            left = len(self._open)
        if not drained:
            logger.warning("drain ended with %d requests still open; failing them", left)
        self.stop()
        return drained

    def stop(self) -> None:
        """Stop the core now; requests still open fail with RequestFailed."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            opened = list(self._open.values())
            self._open.clear()
            self._idle.notify_all()
        for open_ in opened:
            open_.stream.close(error=RequestFailed("the server stopped before the request ended"))
        process = self._process
        if process is not None and process.poll() is None:
            with contextlib.suppress(zmq.ZMQError):
                self._send(Stop())
            try:
                process.wait(_STOP_S)
            except subprocess.TimeoutExpired:
                logger.warning("the engine core did not stop in %s s; killing it", _STOP_S)
                process.kill()
                process.wait()
        if process is not None and process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()  # a core still alive sees its lifeline end
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(5.0)
        with self._send_lock:
            self._requests.close(linger=0)
        self._context.term()
        self._folder.cleanup()

    # -- requests -----------------------------------------------------------------------
    def submit(self, request: ActiveRequest) -> RequestStream:
        max_tokens = self.limits.check(len(request.prompt_ids), request.max_tokens)
        request.sampling.check_vocab(self.limits.vocab_size)
        samplings = sample_samplings(request)
        stream = RequestStream(request.request_id, request.n)
        open_ = _Open(request, stream, samplings, live=set(range(request.n)))
        for index, sampling in enumerate(samplings):
            open_.texts[index] = self._text_streams(request, sampling)
        message = AddRequest(
            request_id=request.request_id,
            prompt=tuple(request.prompt_ids),
            samples=tuple(Sample.of(s) for s in samplings),
            max_tokens=max_tokens,
            stop_token_ids=tuple(
                sorted(set(request.stop_token_ids) | (set() if request.ignore_eos else self._eos))
            ),
            prompt_logprobs=_prompt_logprobs(request),
            grammar=_grammar(request.sampling),
            lora=request.lora,
        )
        with self._lock:
            if not self.alive or self._stopping:
                raise Unavailable(self._unavailable_reason())
            if self._draining:
                raise Unavailable("the server is shutting down")
            if request.request_id in self._open:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            if self._waiting + request.n > self._max_queued:
                raise Overloaded(self._waiting, self._retry_after_s(self._waiting))
            self._open[request.request_id] = open_
            self._waiting += request.n
            self._send(message)  # under the lock: the core sees requests in submit order
        return stream

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is; no-op for an unknown or finished one."""
        with self._lock:
            open_ = self._open.pop(request_id, None)
            if open_ is None:
                return
            self._waiting -= len(open_.live - open_.started)
            self._idle.notify_all()
            samples = tuple((request_id, i) for i in sorted(open_.live))
        if samples:
            self._send(Abort(samples))
        open_.stream.close(aborted=True)

    def stats(self) -> EngineStats:
        stats = self._stats
        info = self.info
        return EngineStats(
            waiting_requests=stats.waiting,
            running_requests=stats.running,
            kv_pages_used=stats.pages_total - stats.pages_free,
            kv_pages_total=stats.pages_total,
            alive=self.alive,
            draining=self._draining,
            steps=stats.steps,
            prefix_queries=stats.prefix_queries,
            prefix_hits=stats.prefix_hits,
            prefix_cached_pages=stats.pages_cached,
            preemptions=stats.preemptions,
            kv_cache_bytes=0 if info is None else info.kv_cache_bytes,
            spec_drafts=stats.spec_drafts,
            spec_draft_tokens=stats.spec_draft_tokens,
            spec_accepted_tokens=stats.spec_accepted_tokens,
            spec_accepted_per_position=stats.spec_accepted_per_position,
            lora=(stats.lora_running, stats.lora_waiting, stats.max_loras),
            weight_bytes=0 if info is None else info.weight_bytes,
        )

    # -- the receiver -------------------------------------------------------------------
    def _receive(self) -> None:
        handlers: dict[type, Callable[[FromCore], None]] = {
            Ready: self._on_ready,  # type: ignore[dict-item]
            Outputs: self._on_outputs,  # type: ignore[dict-item]
            Log: self._on_log,  # type: ignore[dict-item]
            Failed: self._on_failed,  # type: ignore[dict-item]
            LoraDone: self.loras.done,  # type: ignore[dict-item]
        }
        try:
            while not self._dead.is_set():
                if not self._outputs.poll(100):
                    continue
                message = decode_from_core(self._outputs.recv())
                handlers[type(message)](message)
        except zmq.ContextTerminated:
            pass
        except BaseException as exc:  # the client's own bug: fail loudly, never hang
            logger.exception("the engine client's receiver failed")
            self._fail(exc)
        finally:
            self._outputs.close(linger=0)

    def _on_ready(self, ready: Ready) -> None:
        self.info = ready
        self.limits = EngineLimits(ready.max_model_len, ready.max_model_len - 1, ready.vocab_size)
        self._eos = self._eos | frozenset(ready.eos_token_ids)
        self._ready.set()

    def _on_log(self, log: Log) -> None:
        extra = None if log.traceback is None else {"traceback": log.traceback}
        logging.getLogger(log.name).log(log.level, "%s", log.message, extra=extra)

    def _on_failed(self, failed: Failed) -> None:
        self._fail(RuntimeError(f"the engine core failed: {failed.error}"))

    def _on_outputs(self, outputs: Outputs) -> None:
        self._stats = outputs.stats
        for request_id, why in outputs.rejected:
            self._reject(request_id, why)
        wakeups = Wakeups()  # one wake-up of the event loop for the step's tokens
        try:
            for token in outputs.tokens:
                self._on_token(token, wakeups)
        finally:
            wakeups.wake()

    def _on_token(self, out: TokenOut, wakeups: Wakeups) -> None:
        open_ = self._open.get(out.request_id)
        if open_ is None or out.index not in open_.live:
            return  # aborted meanwhile (its stream is closed), or ended by a stop string
        if out.error is not None:
            self._reject(out.request_id, f"structured output failed: {out.error}")
            return
        now = time.monotonic()
        timings = open_.stream.timings
        if out.index not in open_.started:
            open_.started.add(out.index)
            with self._lock:
                self._waiting -= 1
            if timings.first_token is None:
                timings.prefill_start = out.scheduled or now
                timings.prefill_end = timings.first_token = now
        text = open_.texts[out.index]
        step = text.add(out.token, last=out.finish == "length", done=out.done)
        sampling = open_.samplings[out.index]
        k = sampling.logprobs
        logprobs = None
        if k is not None:  # the top k, or every one of the logprob_token_ids asked
            top = out.top if sampling.logprob_token_ids else out.top[:k]
            logprobs = (TokenLogprobs(out.token, out.logprob, top),)
        prompt = None
        if out.prompt_logprobs is not None:
            prompt = tuple(
                None if e is None else TokenLogprobs(e[0], e[1], e[2]) for e in out.prompt_logprobs
            )
        open_.stream.push(
            Delta(
                index=out.index,
                text=step.text,
                token_ids=(out.token,),
                logprobs=logprobs,
                finish_reason=step.finish_reason,
                stop_reason=step.stop_reason,
                prompt_tokens=len(open_.request.prompt_ids),
                completion_tokens=text.tokens,
                prompt_logprobs=prompt,
                cached_tokens=out.cached_tokens,
                emitted=now,
            ),
            wakeups,
        )
        if step.finish_reason is None:
            return
        open_.live.discard(out.index)
        if out.finish is None:  # a text rule ended it first: the core stops it too
            self._send(Abort(((out.request_id, out.index),)))
        if not open_.live:
            with self._lock:
                if self._open.get(out.request_id) is open_:
                    del self._open[out.request_id]
                self._sample_ends.extend([now] * open_.request.n)
                self._idle.notify_all()
            open_.stream.close()

    def _reject(self, request_id: str, why: str) -> None:
        """The core could not serve this request (a 400); the others go on."""
        with self._lock:
            open_ = self._open.pop(request_id, None)
            if open_ is None:
                return
            self._waiting -= len(open_.live - open_.started)
            self._idle.notify_all()
        live = tuple((request_id, i) for i in sorted(open_.live))
        if live:
            self._send(Abort(live))
        open_.stream.close(error=RequestRejected(why))

    # -- failure ------------------------------------------------------------------------
    def _watch(self) -> None:
        process = self._process
        assert process is not None
        code = process.wait()
        if not self._stopping:
            self._fail(RuntimeError(f"the engine core exited with code {code}"))
        self._dead.set()

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            opened = list(self._open.values())
            self._open.clear()
            listeners, self._listeners = self._listeners, []
            self._idle.notify_all()
        failure = RequestFailed(f"the engine failed: {error}")
        for open_ in opened:
            open_.stream.close(error=failure)
        self._dead.set()
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
        for listener in listeners:
            try:
                listener(error)
            except Exception:
                logger.exception("engine failure listener raised")

    def _send(self, message: ToCore) -> None:
        data = encode(message)
        with self._send_lock:
            self._requests.send(data)

    def _retry_after_s(self, backlog: int) -> float:
        ends = self._sample_ends
        if len(ends) >= 2 and ends[-1] > ends[0]:
            rate = (len(ends) - 1) / (ends[-1] - ends[0])
        else:
            rate = 8.0  # nothing measured yet
        return min(_MAX_RETRY_AFTER_S, max(1.0, backlog / rate))

    def _unavailable_reason(self) -> str:
        if self._error is not None:
            return f"the engine failed: {self._error}"
        if not self._ready.is_set():
            return "the engine is not ready"
        return "the engine is stopped"


def _prompt_logprobs(request: ActiveRequest) -> int | None:
    """Alternatives per prompt position: vLLM's prompt_logprobs k; the old echo flag asks
    for as many as the request's logprobs."""
    asked: object = request.prompt_logprobs
    if asked is None or asked is False:
        return None
    if asked is True:
        return request.sampling.logprobs or 0
    return int(asked)  # type: ignore[call-overload]


def _grammar(sampling: SamplingParams) -> Grammar | None:
    constraint = sampling.constraint
    if constraint is None:
        return None
    kind, text = constraint.spec
    return Grammar(kind, text)
