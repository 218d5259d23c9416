"""Server processes of the benchmark: command holes, no machine paths in results, start/stop."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from bench import servers


def test_command_fills_every_hole() -> None:
    spec = servers.ServerSpec("x", ("prog", "--m", "{model}", "-p", "{port}", "{slots}/{context}"))
    assert spec.command(Path("ckpt"), "n", 5, 4, 64) == ["prog", "--m", "ckpt", "-p", "5", "4/64"]


def test_public_command_names_no_path_of_this_machine() -> None:
    spec = servers.peer_from_template(
        "p", "/venv/bin/python3 -m srv --model /data/m.gguf -x {port}"
    )
    assert spec.public_command() == "python -m srv --model m.gguf -x '{port}'"
    assert servers.ours().public_command().startswith("python -m server --model '{model}'")


def test_vllm_runs_as_its_cpu_guide_tunes_it(tmp_path: Path) -> None:
    """Every core bound for the model, none reserved, Intel OpenMP from the peer's venv
    preloaded; results name the libraries, not their folders."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    env = servers.vllm_cpu_tuning(str(tmp_path / "bin" / "python"), cores=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["LD_PRELOAD"].split()[-1] == str(tmp_path / "lib" / "libiomp5.so")
    spec = servers.vllm(str(tmp_path / "bin" / "python"))
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-")
    preloaded = spec.public_env()["LD_PRELOAD"].split()
    assert preloaded[-1] == "libiomp5.so" and all("/" not in lib for lib in preloaded)


def test_missing_interpreter_or_module_is_a_reason_to_skip() -> None:
    assert "not found" in servers.missing(servers.vllm("/no/such/python"))
    spec = servers.ServerSpec("x", (sys.executable, "-m", "no_such_module_here"))
    assert "not installed" in servers.missing(spec)
    assert servers.missing(servers.ServerSpec("x", (sys.executable, "-m", "http.server"))) is None


def test_started_waits_until_ready_and_stops_the_process(tmp_path: Path) -> None:
    argv = (sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1", "-d", "{model}")
    spec = servers.ServerSpec("static", argv, ready_path="/")
    with servers.started(spec, tmp_path, "n", 1, 8, ready_timeout_s=60, log_dir=tmp_path) as run:
        assert httpx.get(run.base_url + "/").status_code == 200
        process = run.process
    assert process.poll() is not None


LOADING_SERVER = """
import http.server, sys, time
ready_at = time.monotonic() + float(sys.argv[2])
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/ready":
            code = 200 if time.monotonic() >= ready_at else 503
        else:
            code = 200 if self.path == "/v1/models" else 404
        self.send_response(code)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_a_peer_that_lists_its_model_while_loading_is_ready_only_at_ready(tmp_path: Path) -> None:
    script = tmp_path / "loading.py"
    script.write_text(LOADING_SERVER)
    spec = servers.peer_from_template("p", f"{sys.executable} {script} {{port}} 3")
    with servers.started(spec, tmp_path, "n", 1, 8, ready_timeout_s=60, log_dir=tmp_path) as run:
        assert httpx.get(run.base_url + "/ready").status_code == 200
        assert run.startup_s >= 2.5


def test_a_peer_without_ready_is_ready_when_it_lists_models(tmp_path: Path) -> None:
    script = tmp_path / "no_ready.py"
    script.write_text(LOADING_SERVER.replace('self.path == "/ready"', "False"))
    spec = servers.peer_from_template("p", f"{sys.executable} {script} {{port}} 0")
    with servers.started(spec, tmp_path, "n", 1, 8, ready_timeout_s=60, log_dir=tmp_path) as run:
        assert httpx.get(run.base_url + "/v1/models").status_code == 200
