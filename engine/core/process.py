"""The engine core's own process: `python -m engine.core.process CONFIG_JSON`.

Runs on: a child of the HTTP process (frontend.core_process starts it), its main thread running
the CoreLoop. Owns: the two sockets to the parent (ZMQ PULL for requests, PUSH for
outputs), the process's logging (every record is forwarded to the parent, which writes
it in the server's format), the compile cache setting, and the exit code: 0 after a
`Stop`, 1 after a failure (reported first as `Failed`).

Why a process: the scheduler loop and XLA's threads get the GIL and the cores to
themselves; the HTTP process's parsing, tokenizing and detokenizing no longer slow the
steps (engine/core's design note in the repository's README). Why ZMQ: non-blocking
sockets with a poll timeout on both ends, one frame a message, and the same code over
ipc:// here and tcp:// between hosts.

If the parent goes away, the core exits at once (its stdin is the parent's pipe).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from engine.core.config import CoreConfig
from engine.core.messages import FromCore, Log, Ready, ToCore, decode_to_core, encode
from engine.xla_flags import set_backend_flags

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessConfig:
    """Everything the child needs, sent as JSON on its command line."""

    core: CoreConfig
    # the parent binds both (frontend.core_process sets them); the child connects
    requests_address: str = ""
    outputs_address: str = ""
    log_level: int = logging.INFO
    compile_cache_dir: str | None = None  # JAX_COMPILATION_CACHE_DIR, when set, wins
    fail_after_steps: int | None = None  # test hook: the loop fails after this many steps
    structured_outputs: bool = True  # compile grammars (needs the checkpoint's tokenizer)
    # multi-host (engine.multihost): this core is process 0 of num_processes and leads
    num_processes: int = 1
    coordinator_address: str | None = None
    distributed_timeout: float = 300.0  # seconds for every process to join
    # disaggregated (engine.core.disaggregated): the two device sets, as engine.mesh reads them
    prefill_devices: str | None = None
    generate_devices: str | None = None

    def to_json(self) -> str:
        return json.dumps({**self.__dict__, "core": self.core.to_fields()})

    @classmethod
    def from_json(cls, text: str) -> ProcessConfig:
        fields = json.loads(text)
        return cls(**{**fields, "core": CoreConfig.from_fields(fields["core"])})


class _Channel:
    """The child's ends of the two sockets; `send` may be called from any thread (log
    records come from XLA's and JAX's threads too)."""

    def __init__(self, config: ProcessConfig) -> None:
        self._context = zmq.Context()
        self._requests = self._context.socket(zmq.PULL)
        self._requests.connect(config.requests_address)
        self._outputs = self._context.socket(zmq.PUSH)
        self._outputs.setsockopt(zmq.LINGER, 5000)
        self._outputs.connect(config.outputs_address)
        self._lock = threading.Lock()

    def send(self, message: FromCore) -> None:
        data = encode(message)
        with self._lock:
            self._outputs.send(data)

    def receive(self, block: bool) -> list[ToCore]:
        """Every message waiting; with `block`, at least one."""
        out: list[ToCore] = []
        while True:
            flags = 0 if block and not out else zmq.NOBLOCK
            if flags == 0:
                self._requests.poll()
            try:
                data = self._requests.recv(flags)
            except zmq.Again:
                return out
            out.append(decode_to_core(data))

    def close(self) -> None:
        self._requests.close(linger=0)
        self._outputs.close()
        self._context.term()


class _Forward(logging.Handler):
    """Every log record of the child, formatted, to the parent."""

    def __init__(self, channel: _Channel) -> None:
        super().__init__()
        self._channel = channel
        self._formatter = logging.Formatter()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            trace = None
            if record.exc_info:
                trace = self._formatter.formatException(record.exc_info)
            self._channel.send(Log(record.levelno, record.name, record.getMessage(), trace))
        except Exception:  # a log line must never take the core down
            self.handleError(record)


def _grammar_compiler(tokenizer: Any, vocab_size: int) -> Any:
    from tokenization.grammar import GrammarSpec

    compiler = tokenizer.grammar_compiler(vocab_size)

    def compile_grammar(kind: str, text: str) -> Any:
        return compiler.compile(GrammarSpec(kind, text))  # type: ignore[arg-type]

    return compile_grammar


def enable_compile_cache(folder: str) -> str:
    """Keep XLA's compiled programs on disk (every shape), so a restart warms up from them:
    under `folder`, unless the environment already named one (JAX_COMPILATION_CACHE_DIR:
    the container image sets it). Returns the folder in use."""
    import jax

    current = getattr(jax.config, "jax_compilation_cache_dir", None)
    if not current:
        Path(folder).mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", folder)
        current = folder
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    logger.info("compile cache: %s", current)
    return str(current)


def _die_with_parent() -> None:
    """The parent holds the write end of this process's stdin: end of file there means it
    is gone, and a core must never outlive (or keep compiling for) a server that is."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 4096):  # the raw descriptor: no buffer lock at shutdown
                pass
        os._exit(1)

    threading.Thread(target=watch, name="engine-core-parent", daemon=True).start()


def run(config: ProcessConfig) -> int:
    _die_with_parent()
    channel = _Channel(config)
    root = logging.getLogger()
    root.handlers[:] = [_Forward(channel)]
    root.setLevel(config.log_level)
    try:
        # before jax starts a backend: XLA reads XLA_FLAGS once (engine.xla_flags)
        platform = set_backend_flags(os.environ)
        logger.info("XLA flags for %s: %s", platform, os.environ.get("XLA_FLAGS", ""))
        if config.compile_cache_dir:
            enable_compile_cache(config.compile_cache_dir)
        if platform == "cpu":  # the compiler runs beside the checkpoint's loading
            from engine import row_dot

            threading.Thread(target=row_dot.available, name="row-dot-build", daemon=True).start()
        from engine.core.core import EngineCore
        from engine.core.disaggregated import DisaggregatedCore
        from engine.core.loop import CoreLoop
        from engine.heap import freeze_startup_heap

        leader = None
        core: EngineCore | DisaggregatedCore
        if config.num_processes > 1:  # this core leads the others' (engine.multihost)
            from engine.multihost import Leader

            assert config.coordinator_address is not None  # ServerConfig checked it
            leader = Leader.start(
                config.coordinator_address, config.num_processes, config.distributed_timeout
            )
            core = leader.build(config.core)
        elif config.prefill_devices is not None and config.generate_devices is not None:
            core = DisaggregatedCore.build(
                config.core, config.prefill_devices, config.generate_devices
            )
        else:
            core = EngineCore(config.core)
        core.warmup()
        from tokenization import Tokenizer

        # the checkpoint's tokenizer, loaded here once: its EOS ids join the model's (the
        # core decides EOS), and structured outputs' grammars compile against it
        tokenizer = Tokenizer.from_folder(Path(core.config.model_path))
        grammar = None
        if config.structured_outputs:
            grammar = _grammar_compiler(tokenizer, core.limits.vocab_size)
        args = (channel.receive, channel.send, grammar, config.fail_after_steps)
        loop: CoreLoop[Any] = CoreLoop(core, *args, eos_token_ids=tokenizer.eos_token_ids)
        logger.info("engine core: startup heap frozen (%d objects)", freeze_startup_heap())
        channel.send(
            Ready(
                max_model_len=core.limits.max_model_len,
                vocab_size=core.limits.vocab_size,
                eos_token_ids=tuple(sorted(loop.eos_token_ids)),
                kv_cache_bytes=core.kv_cache_bytes,
                weight_bytes=core.weight_bytes,
                num_pages=core.num_pages,
                page_size=core.page_size,
            )
        )
        loop.run()
        if leader is not None:
            leader.stop()
    except SystemExit as exc:
        logger.warning("engine core exiting: %s", exc)
        return 1
    except BaseException as exc:
        from engine.core.messages import Failed

        logger.exception("engine core failed")
        channel.send(Failed(f"{type(exc).__name__}: {exc}"))
        channel.close()
        return 1
    channel.close()
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 1:
        raise SystemExit("usage: python -m engine.core.process CONFIG_JSON")
    sys.exit(run(ProcessConfig.from_json(args[0])))


if __name__ == "__main__":
    main()
