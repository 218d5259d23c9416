"""Server configuration: one frozen dataclass built from flags, then env, then defaults.

This is the only module that reads `os.environ` (through the `environ` argument of
`parse_config`, which `__main__` fills). Every flag `--some-flag` also comes from the
environment variable `LLM_SERVER_SOME_FLAG`; a flag beats the variable, the variable
beats the default.

The engine core's part is typed too: `ServerConfig.core_config` builds the core's
`CoreConfig` (engine.core.config), which owns and checks its fields; a ServerConfig
builds one when it is made, so a bad flag fails here, before anything starts. A new
engine flag touches this file (the field, its flag, its line in `core_config`) and
engine/core/config.py.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from engine.core.config import CoreConfig
from engine.core.speculation import SpeculativeConfig
from engine.faults import FaultPlan
from engine.model_source import DEFAULT_MODEL, DEMO, DEMO_NAME
from engine.types import KV_CACHE_DTYPES, QUANTIZATIONS
from server.lora import LoraModule, parse_lora_modules
from server.tool_parsers import PARSERS as TOOL_PARSERS

ENV_PREFIX = "LLM_SERVER_"
LOG_FORMATS = ("json", "text")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True)
class ServerConfig:
    """Everything the HTTP server and the model it serves are configured with."""

    model: Path | None = None
    served_model_name: str | None = None
    host: str = "0.0.0.0"
    port: int = 8000
    # The engine core (engine/core/; vLLM's names): sequences decoding at once, the tokens
    # one step takes (every decode row plus prompt chunks), positions per prompt chunk and
    # per KV page.
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None  # None: prefill_chunk + max_num_seqs
    # a multiple of page_size (rounded down to one); None: the backend's (CPU 128, TPU
    # 1024: engine.core.defaults)
    prefill_chunk: int | None = None
    # per prompt chunk in a step with decode rows, where the attention backend allows it;
    # None: the backend's (engine.core.defaults: prefill_chunk everywhere today)
    prefill_chunk_beside_decode: int | None = None
    page_size: int = 16
    prefix_caching: bool = True  # prompts share cached leading pages (vLLM's default)
    async_scheduling: bool = True  # the core plans step N + 1 while step N runs
    speculative_config: str | None = None  # vLLM's JSON, e.g. {"method": "ngram", ...}
    max_model_len: int | None = None  # None: the checkpoint's (capped by the engine)
    dtype: str = "float32"
    # Quantization (engine/quant.py, engine/attention/kv_dtype.py; vLLM's flags): int8
    # weights per output channel, and the KV pages' dtype (auto: the model's).
    quantization: str | None = None  # None or "int8"
    kv_cache_dtype: str = "auto"  # auto, int8, fp8 (= fp8_e4m3), fp8_e5m2
    # The KV cache's pages: this many bytes per device, else gpu_memory_utilization of each
    # accelerator's memory less the params, else (XLA:CPU reports no memory) max_num_seqs
    # whole contexts.
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_queued_samples: int = 256  # admission bound, in samples (prompts x n), before 429
    api_key: str | None = None
    log_level: str = "info"
    log_format: str = "json"
    chat_template: Path | None = None
    drain_timeout: float = 30.0
    sse_ping_interval: float = 15.0
    max_request_bytes: int = 1_000_000
    # Connection deadlines (seconds): a client that stalls is cut, not waited for.
    timeout_keep_alive: float = 5.0  # idle between requests on a kept-alive connection
    header_read_timeout: float = 10.0  # request line + headers, from connect or first byte
    body_read_timeout: float = 30.0  # the whole request body, from the end of the headers
    cache_dir: Path | None = None
    compile_cache: bool = True  # XLA compilations kept under cache_dir/jax across restarts
    fault_injection: str | None = None
    # Request limits; each violation is a 400 that names the limit.
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_prompts: int = 64
    max_request_samples: int = 64  # prompts x n of one request; < the admission bound
    tokenizer_workers: int = 2  # threads that tokenize and render chat templates
    # Tool calling (vLLM's flags): the reply format read for tool_choice auto.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    enable_tokenizer_info_endpoint: bool = False  # vLLM's: GET /tokenizer_info (its template)
    # Responses kept in memory for GET, cancel and previous_response_id (server.response_store)
    responses_store_size: int = 1000
    # Devices (see engine/mesh.py): one tensor-parallel mesh, or a prefill and a generate
    # set (disaggregated). A device set is a count (the first N devices; generate takes the
    # ones after prefill's) or ids: "0,1", "2-3".
    tensor_parallel_size: int = 1
    prefill_devices: str | None = None
    generate_devices: str | None = None
    # Multi-host (jax.distributed): process 0 serves HTTP, the others follow its schedule.
    coordinator_address: str | None = None  # host:port of process 0's coordinator
    num_processes: int = 1
    process_id: int | None = None  # this process's index; needed with num_processes > 1
    distributed_timeout: float = 300.0  # seconds to wait for every process to join
    # LoRA adapters (vLLM's flags; engine/lora.py, server/lora.py): each served as a model
    # of its own name, `max_loras` of them on the devices at once.
    enable_lora: bool = False
    lora_modules: tuple[LoraModule, ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    enable_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and unload

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, got {self.responses_store_size}")
        for name in ("max_queued_samples", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "max_n",
            "max_stop_strings",
            "max_stop_string_chars",
            "max_prompts",
            "max_request_samples",
            "tokenizer_workers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prefill_chunk", "prefill_chunk_beside_decode"):
            chunk = getattr(self, name)
            if chunk is not None and chunk < self.page_size:
                raise ValueError(
                    f"{name} must be at least page_size ({self.page_size}), got {chunk}"
                )
        budget = self.kv_cache_memory_bytes
        if budget is not None and budget < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {budget}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.fault_injection is not None:
            FaultPlan.parse(self.fault_injection)
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be json or text, got {self.log_format!r}")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0 seconds, got {self.drain_timeout}")
        if self.sse_ping_interval < 0:
            raise ValueError("sse_ping_interval must be >= 0 seconds (0 disables pings)")
        for name in ("timeout_keep_alive", "header_read_timeout", "body_read_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty when given")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be blank")
        parsers = ", ".join(TOOL_PARSERS)
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {parsers}, got {self.tool_call_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(f"enable_auto_tool_choice needs tool_call_parser ({parsers})")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if (self.prefill_devices is None) != (self.generate_devices is None):
            raise ValueError("prefill_devices and generate_devices go together (disaggregated)")
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id must be in 0..{self.num_processes - 1}, got {self.process_id}"
            )
        if self.num_processes > 1 and (not self.coordinator_address or self.process_id is None):
            raise ValueError(
                "num_processes > 1 needs coordinator_address (host:port of process 0) and "
                "process_id"
            )
        if self.num_processes > 1 and self.prefill_devices is not None:
            raise ValueError("a multi-host server is not disaggregated (prefill_devices)")
        if self.speculative_config is not None and self.prefill_devices is not None:
            raise ValueError("speculative_config does not combine with prefill_devices yet")
        self._check_lora()
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be > 0, got {self.distributed_timeout}")
        self.core_config(model_path="")  # the core's fields, checked by their owner

    def core_config(self, model_path: str) -> CoreConfig:
        """The engine core's typed config: the flags it reads, under the core's names."""
        return CoreConfig(
            model_path=model_path,
            dtype=self.dtype,
            quantization=self.quantization or "none",
            kv_cache_dtype=self.kv_cache_dtype,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.batched_tokens,
            chunk_size=self.prefill_chunk,
            decode_chunk_size=self.prefill_chunk_beside_decode,
            page_size=self.page_size,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            memory_utilization=self.gpu_memory_utilization,
            prefix_caching=self.prefix_caching,
            async_scheduling=self.async_scheduling,
            tensor_parallel_size=self.tensor_parallel_size,
            speculative_config=self.speculative_config,
            # LoRA: the core reads (and checks) each adapter before it is ready
            max_loras=self.max_loras if self.enable_lora else 0,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
            lora_modules=tuple((m.name, str(m.path)) for m in self.lora_modules),
        )

    def _check_lora(self) -> None:
        if not self.enable_lora:
            for name in ("lora_modules", "enable_runtime_lora_updating"):
                if getattr(self, name):
                    raise ValueError(f"{name} needs enable_lora")
            return
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras must be >= max_loras ({self.max_loras})")
        if any(m.name == self.model_name for m in self.lora_modules):
            raise ValueError(
                f"a LoRA module may not take the served model's name {self.model_name}"
            )
        if self.prefill_devices is not None or self.num_processes > 1:
            raise ValueError(
                "enable_lora does not combine with prefill_devices or num_processes yet"
            )

    @property
    def batched_tokens(self) -> int | None:
        """The tokens one step takes: by default a whole prompt chunk beside every decode
        row, so a prompt never waits for the running sequences to finish (None: the
        backend's chunk decides, in the engine core)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.prefill_chunk is None:
            return None
        return self.prefill_chunk + self.max_num_seqs

    @property
    def request_sample_limit(self) -> tuple[int, str]:
        """(most samples one request may ask for, the flag that sets it): a request larger
        than the whole admission bound could never be admitted."""
        if self.max_queued_samples < self.max_request_samples:
            return self.max_queued_samples, "max_queued_samples"
        return self.max_request_samples, "max_request_samples"

    @property
    def model_name(self) -> str:
        """The id clients use: --served-model-name, else the checkpoint's file or folder name
        (the default model's and the demo's own names when --model is absent or `demo`)."""
        if self.served_model_name:
            return self.served_model_name
        if self.model is None:
            return DEFAULT_MODEL.name
        return DEMO_NAME if str(self.model) == DEMO else self.model.name

    @property
    def compile_cache_dir(self) -> Path:
        """Where compiled XLA programs are kept (JAX_COMPILATION_CACHE_DIR, when set, wins)."""
        return self.resolved_cache_dir / "jax"

    @property
    def resolved_cache_dir(self) -> Path:
        if self.cache_dir is not None:
            return self.cache_dir
        return Path.home() / ".cache" / "jax-llm-server"


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def _byte_size(text: str) -> int:
    """Bytes: a number with an optional unit, 512MiB, 8GiB, 2GB, 1e9."""
    value = text.strip().lower().removesuffix("b")
    unit = value.lstrip("0123456789.e+")
    try:
        return int(float(value[: len(value) - len(unit)]) * _UNITS[unit])
    except (KeyError, ValueError) as exc:
        raise ValueError(f"a size in bytes like 8GiB or 512MiB, got {text!r}") from exc


def _model(text: str) -> Path | None:
    """A checkpoint path, or `demo` (a folder of that name is given as ./demo)."""
    if not text or text == DEMO:
        return Path(text) if text else None
    path = Path(text).expanduser()
    return path.absolute() if str(path) == DEMO else path


def _optional_path(text: str) -> Path | None:
    return Path(text).expanduser() if text else None


def _one_of(choices: Sequence[str]) -> Callable[[str], str]:
    """A parser taking one of `choices` (the error then names the flag or variable)."""

    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {text!r}")
        return text

    return parse


def _switch(text: str) -> bool:
    """An on/off flag: `--flag` alone is on; the flag or its variable may say true or false."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"must be true or false, got {text!r}")


def _speculative(text: str) -> str:
    """vLLM's speculative config as JSON text, checked here (the core parses it again)."""
    SpeculativeConfig.parse(text)
    return text


# flag name -> (parser from text, help)
_FLAGS: dict[str, tuple[object, str]] = {
    "model": (
        _model,
        "a local Hugging Face checkpoint folder, a GGUF file (or a folder holding one), or "
        f"`demo` (a random tiny model; default: {DEFAULT_MODEL.name}, fetched once)",
    ),
    "served_model_name": (str, "model id in the API (default: the folder's name)"),
    "host": (str, "bind address"),
    "port": (int, "bind port"),
    "max_num_seqs": (int, "sequences decoding at once (vLLM's name; --max-slots as well)"),
    "max_num_batched_tokens": (
        int,
        "tokens one step takes: every decode row, then prompt chunks "
        "(default prefill-chunk + max-num-seqs)",
    ),
    "prefill_chunk": (
        int,
        "prompt positions one step computes of a prompt (page multiple; default CPU 128, TPU 1024)",
    ),
    "prefill_chunk_beside_decode": (
        int,
        "prompt positions per chunk in a step with decode rows, where the attention "
        "backend gives a query the same bits in any chunk (page multiple; default the chunk)",
    ),
    "page_size": (int, "positions per KV page"),
    "prefix_caching": (_switch, "share prompts' cached leading pages (default on)"),
    "async_scheduling": (_switch, "plan the next step while one runs (default on)"),
    "speculative_config": (
        _speculative,
        'speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}',
    ),
    "max_model_len": (int, "context length: prompt + completion tokens"),
    "dtype": (str, "float32 or bfloat16"),
    "quantization": (_one_of(QUANTIZATIONS), "int8: weights per output channel (default none)"),
    "kv_cache_dtype": (_one_of(KV_CACHE_DTYPES), "KV pages: auto (model's), int8, fp8, fp8_e5m2"),
    "kv_cache_memory_bytes": (_byte_size, "KV pages' bytes per device, e.g. 8GiB"),
    "gpu_memory_utilization": (float, "of each accelerator's memory for params + KV (0..1]"),
    "max_queued_samples": (int, "samples (prompts x n) waiting for prefill before 429"),
    "api_key": (str, "require 'Authorization: Bearer <key>' on /v1 routes"),
    "log_level": (str, "debug, info, warning, error"),
    "log_format": (str, "json (one object a line) or text"),
    "chat_template": (_optional_path, "Jinja chat template file overriding the checkpoint's"),
    "drain_timeout": (float, "seconds in-flight requests get after SIGTERM"),
    "sse_ping_interval": (float, "seconds between ': ping' keep-alive comments (0: none)"),
    "max_request_bytes": (int, "largest accepted request body"),
    "timeout_keep_alive": (float, "seconds a kept-alive connection may idle between requests"),
    "header_read_timeout": (float, "seconds a client has to send a request's headers"),
    "body_read_timeout": (float, "seconds a client has to send a whole request body"),
    "cache_dir": (
        _optional_path,
        "the default and demo models, prepared GGUF folders and the compile cache "
        "(default ~/.cache/...)",
    ),
    "compile_cache": (_switch, "keep compiled programs under cache-dir/jax: restarts warm fast"),
    "fault_injection": (str, "test-only: fail the engine core, e.g. core:after=3 (steps)"),
    "max_n": (int, "largest n per request"),
    "max_stop_strings": (int, "most stop strings per request"),
    "max_stop_string_chars": (int, "longest stop string"),
    "max_prompts": (int, "most prompts in one /v1/completions request"),
    "max_request_samples": (int, "most samples (prompts x n) in one request"),
    "tokenizer_workers": (int, "threads tokenizing prompts off the event loop"),
    "enable_auto_tool_choice": (_switch, "read tool calls from replies to tool_choice auto"),
    "tool_call_parser": (str, f"tool-call format of the model: {', '.join(TOOL_PARSERS)}"),
    "enable_tokenizer_info_endpoint": (_switch, "serve GET /tokenizer_info (shows the template)"),
    "responses_store_size": (
        int,
        "Responses API responses kept in memory for GET, cancel and previous_response_id "
        "(0: none; store is then ignored and background refused)",
    ),
    "tensor_parallel_size": (int, "devices the model is sharded over (heads, MLP, vocabulary)"),
    "prefill_devices": (str, "disaggregated: prefill's devices, a count or ids (0,1 or 0-1)"),
    "generate_devices": (str, "disaggregated: generate's devices, a count or ids (2,3 or 2-3)"),
    "coordinator_address": (str, "multi-host: host:port of process 0 (jax.distributed)"),
    "num_processes": (int, "multi-host: processes in the server (1: one host)"),
    "process_id": (int, "multi-host: this process's index, 0 serves HTTP"),
    "distributed_timeout": (float, "multi-host: seconds to wait for every process to join"),
    "enable_lora": (_switch, "serve LoRA adapters (vLLM's flag)"),
    "lora_modules": (
        parse_lora_modules,
        'adapters served at start: name=path or {"name", "path", "base_model_name"}, several',
    ),
    "max_loras": (int, "LoRA adapters on the devices at once (default 1)"),
    "max_lora_rank": (int, "the largest LoRA rank served (default 16)"),
    "max_cpu_loras": (int, "LoRA adapters kept in host memory (default max-loras)"),
    "enable_runtime_lora_updating": (
        _switch,
        "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (server-side paths)",
    ),
}


# Older names, read as the flag they name (a flag given both ways takes the new name's value).
_ALIASES = {"max_slots": "max_num_seqs"}


def _default_cache_dir(environ: Mapping[str, str]) -> Path:
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jax-llm-server"


def parse_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ServerConfig:
    """Build the config from command-line flags and `LLM_SERVER_*` environment variables.

    Raises ValueError with a message naming the bad flag or variable.
    """
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="llm-server", description="OpenAI-compatible server for a JAX LLM engine"
    )
    for name, (convert, help_text) in _FLAGS.items():
        flag = "--" + name.replace("_", "-")
        switch: dict[str, Any] = {"nargs": "?", "const": "true"} if convert is _switch else {}
        if convert is parse_lora_modules:
            switch = {"nargs": "+"}  # vLLM's: several adapters after one flag
        parser.add_argument(
            flag, dest=name, default=None, help=f"{help_text} [env {_env(name)}]", **switch
        )
    for old, new in _ALIASES.items():
        parser.add_argument("--" + old.replace("_", "-"), dest=old, default=None, help="=" + new)
    args = parser.parse_args(list(argv) if argv is not None else None)

    values: dict[str, object] = {}
    for old, new in _ALIASES.items():
        if getattr(args, new) is None and environ.get(_env(new)) in (None, ""):
            setattr(args, new, getattr(args, old) or environ.get(_env(old)) or None)
    for name, (convert, _) in _FLAGS.items():
        raw = getattr(args, name)
        source = "--" + name.replace("_", "-")
        if raw is None:
            raw = environ.get(_env(name)) or None  # an empty variable counts as unset
            source = _env(name)
        if raw is None:
            continue
        try:
            values[name] = convert(raw)  # type: ignore[operator]
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from exc
    if "cache_dir" not in values or values["cache_dir"] is None:
        values["cache_dir"] = _default_cache_dir(environ)
    if values.get("api_key") == "":
        values["api_key"] = None
    known = {f.name for f in fields(ServerConfig)}
    return ServerConfig(**{k: v for k, v in values.items() if k in known})  # type: ignore[arg-type]


def _env(name: str) -> str:
    return ENV_PREFIX + name.upper()
