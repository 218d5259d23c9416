"""The image's contents, without a container runtime: what the Dockerfile does, done here.

CI cannot pull base images (it reaches package registries only), so the image is not built.
Instead this test repeats its steps on the host: the build context that .dockerignore lets
through is built into a wheel and installed (no editable install, no repository on the path)
into a fresh virtual environment; `python -m server` then runs from an empty folder with the
final stage's environment, and the Dockerfile's own HEALTHCHECK command must pass. That
catches a package that only works from a source checkout (missing package data, imports of
test code) and a HEALTHCHECK that cannot succeed.
"""

from __future__ import annotations

import json
import os
import shutil
import site as sitelib
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import httpx
import pytest

from tests.deploy.ingress_nginx import free_port, stop_process

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
IMAGE_CACHE = "/var/cache/llm-server"


def _final_stage_lines() -> list[str]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("FROM ")]
    return [line for line in lines[starts[-1] :] if line and not line.startswith("#")]


def _image_environment() -> dict[str, str]:
    env: dict[str, str] = {}
    for line in _final_stage_lines():
        if line.startswith("ENV "):
            for pair in line.removeprefix("ENV ").split():
                name, _, value = pair.partition("=")
                env[name] = value
    return env


def _healthcheck_command() -> list[str]:
    (line,) = [line for line in _final_stage_lines() if line.startswith("HEALTHCHECK ")]
    command = json.loads(line[line.index("CMD ") + 4 :])
    assert isinstance(command, list), "HEALTHCHECK CMD in exec form"
    return command


def _build_context(target: Path) -> Path:
    """What .dockerignore lets into the build: pyproject, readme, the three packages."""
    target.mkdir()
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        if not line.startswith("!"):
            continue
        source = ROOT / line[1:].rstrip("/")
        if source.is_dir():
            shutil.copytree(
                source, target / source.name, ignore=shutil.ignore_patterns("__pycache__")
            )
        elif source.is_file():
            shutil.copy2(source, target / source.name)
    return target


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _run(command: list[str], **kwargs: object) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"


def test_installed_package_serves_and_passes_the_healthcheck(tmp_path: Path) -> None:
    started = time.monotonic()
    context = _build_context(tmp_path / "context")
    wheels = tmp_path / "wheels"
    # The build backend of the host when it is recent enough, else pip's isolated build.
    isolation = [] if int(version("setuptools").split(".")[0]) < 68 else ["--no-build-isolation"]
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(wheels)]
        + [str(context)],
        timeout=240,
    )
    # Dependencies come from the running interpreter's site-packages (a virtual environment's
    # too: `venv --system-site-packages` would see only the base interpreter's), named in a
    # .pth file, whose own .pth hooks (the editable install of this repo) are not run; the
    # package itself comes only from the wheel.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = str(venv / "bin" / "python")
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    host_sites = [*sitelib.getsitepackages(), sitelib.getusersitepackages()]
    (Path(site) / "host-packages.pth").write_text("\n".join(host_sites) + "\n")
    (wheel,) = wheels.glob("*.whl")
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, str(wheel)])

    print(f"wheel + venv: {time.monotonic() - started:.1f} s")
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    cache = tmp_path / "cache"
    port = free_port()
    env = {k: v.replace(IMAGE_CACHE, str(cache)) for k, v in _image_environment().items()}
    env.update(
        PATH=f"{venv / 'bin'}:{os.environ['PATH']}",
        JAX_PLATFORMS="cpu",
        LLM_SERVER_HOST="127.0.0.1",
        LLM_SERVER_PORT=str(port),
        LLM_SERVER_MODEL="demo",  # nothing mounted: the embedded demo model
        LLM_SERVER_MAX_MODEL_LEN="256",
        LLM_SERVER_MAX_NUM_SEQS="2",
        LLM_SERVER_LOG_FORMAT="text",
    )
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # the test session's warm compile cache
        env["JAX_COMPILATION_CACHE_DIR"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
    where = subprocess.run(
        [python, "-c", "import server; print(server.__file__)"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(site), f"server imported from {where}, not from the wheel"

    log = tmp_path / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [python, "-m", "server"], cwd=workdir, env=env, stdout=out, stderr=out
        )
    try:
        healthcheck = _healthcheck_command()  # "python" resolves through the image PATH
        deadline = time.monotonic() + 240  # healthy once loaded and warm: a cold first start
        while subprocess.run(healthcheck, cwd=workdir, env=env, check=False).returncode != 0:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"HEALTHCHECK never passed:\n{log.read_text()}"
            time.sleep(0.5)
        print(f"healthy after {time.monotonic() - started:.1f} s")
        while not _answers(f"http://127.0.0.1:{port}/ready"):
            assert process.poll() is None, f"server exited:\n{log.read_text()}"
            assert time.monotonic() < deadline + 120, f"never ready:\n{log.read_text()}"
            time.sleep(0.5)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "Hello", "max_tokens": 4, "temperature": 0},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        print(f"served after {time.monotonic() - started:.1f} s")
    finally:
        stop_process(process, 30)
    # A read-only root filesystem suffices: the server wrote only under its cache folder.
    assert list(workdir.iterdir()) == []
    assert (cache / "demo-model" / "config.json").is_file()
