"""Helpers of the deploy tests: render kustomizations with the real kubectl and pick objects.

Rendering goes through the real `kubectl kustomize`, so a manifest kustomize cannot build
fails here the same way it would fail for a user.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu", "tpu")

Manifest = dict[str, Any]


def kustomize(directory: Path) -> list[Manifest]:
    """Render one kustomization with kubectl and parse every object it emits."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: run deploy/ci-setup.sh")
    done = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def find(objects: list[Manifest], kind: str, name: str | None = None) -> Manifest:
    """The one object of `kind` (and `name`, when given) in a rendered overlay."""
    matches = [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def server_container(objects: list[Manifest]) -> Manifest:
    pod = find(objects, "Deployment")["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "server"]
    return container


def server_environ(objects: list[Manifest]) -> dict[str, str]:
    """The environment the server process sees: its ConfigMap plus the container's own env."""
    container = server_container(objects)
    environ: dict[str, str] = {}
    for source in container.get("envFrom", []):
        config_map = find(objects, "ConfigMap", source["configMapRef"]["name"])
        environ.update(config_map["data"])
    for var in container.get("env", []):
        environ[var["name"]] = var["value"]
    return environ


def server_cli_flags() -> frozenset[str]:
    """Every option the real `python -m server` parser accepts, read from its --help."""
    from server.config import parse_config

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        parse_config(["--help"], environ={})
    flags = frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.getvalue()))
    assert "--model" in flags, out.getvalue()
    return flags


def check_server_variable(name: str, value: str) -> None:
    """An LLM_SERVER_* variable names an exact flag (argparse's prefix matching aside), and
    the server reads the same value from the variable as from the flag."""
    from server.config import ENV_PREFIX, parse_config

    flag = "--" + name.removeprefix(ENV_PREFIX).lower().replace("_", "-")
    assert flag in server_cli_flags(), f"{name}: the server has no flag {flag}"
    assert parse_config([flag, value], environ={}) == parse_config([], environ={name: value})
