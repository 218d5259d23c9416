"""Imports flow one way: server -> frontend -> engine -> tokenization; the HTTP process
(server, frontend) never imports JAX, and the model code stays pure."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# package -> top-level packages it must never import
FORBIDDEN = {
    "tokenization": {"engine", "frontend", "server"},
    "engine": {
        "frontend",
        "server",
        "prometheus_client",
        "prometheus_fastapi_instrumentator",
        "fastapi",
    },
    "frontend": {"server", "jax", "jaxlib", "fastapi", "prometheus_client"},
    "server": {"jax", "jaxlib"},
}
# The engine modules the HTTP process may import: plain data, the messages to the core and
# the core process's command-line config, the flags' own parsers. None of them imports JAX.
JAX_FREE_ENGINE = {
    "engine.types",
    "engine.core.config",
    "engine.core.messages",
    "engine.core.process",
    "engine.core.speculation",
    "engine.faults",
    "engine.heap",
    "engine.model_source",
}
# A multi-host follower is started by `llm-server` but runs an engine core itself
# (server.__main__.follow_main): the one place the server's entry point reaches JAX.
FOLLOWER = {"server/__main__.py": {"engine.multihost"}}
# pure device code: no threads, queues, tokenizers or metrics
PURE_MODULES = ["engine/model.py", "engine/sampling.py"]
PURE_FORBIDDEN = {
    "threading",
    "queue",
    "tokenization",
    "tokenizers",
    "transformers",
    "prometheus_client",
    "asyncio",
    "server",
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "engine":  # `from engine import x`: the module engine.x
                modules.update(f"engine.{alias.name}" for alias in node.names)
            else:
                modules.add(node.module)
    return modules


def imported_roots(path: Path) -> set[str]:
    return {module.split(".")[0] for module in imported_modules(path)}


def test_imported_roots_sees_both_import_forms(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import os.path\nfrom server.app import x\nfrom . import sibling\n")
    assert imported_roots(probe) == {"os", "server"}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_downstream(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources found under {package}/"
    offenders = {
        str(f.relative_to(ROOT)): sorted(imported_roots(f) & FORBIDDEN[package]) for f in files
    }
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize("package", ["server", "frontend"])
def test_the_http_process_imports_only_jax_free_engine_modules(package: str) -> None:
    offenders = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        name = str(path.relative_to(ROOT))
        engine = {m for m in imported_modules(path) if m.split(".")[0] == "engine"}
        bad = engine - JAX_FREE_ENGINE - FOLLOWER.get(name, set())
        if bad:
            offenders[name] = sorted(bad)
    assert offenders == {}


def test_importing_the_server_app_loads_no_jax() -> None:
    """What the rules above are for, checked in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", "import server.app, sys; assert 'jax' not in sys.modules"],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("module", PURE_MODULES)
def test_model_code_is_pure(module: str) -> None:
    path = ROOT / module
    assert path.exists(), f"{module} is missing"
    assert sorted(imported_roots(path) & PURE_FORBIDDEN) == []


@pytest.mark.parametrize("package", ["engine", "frontend"])
def test_every_module_says_what_it_owns(package: str) -> None:
    """The rule a line cap stood for: a module owns one thing, and says which in its
    docstring (STYLE: "a header that says who runs it and what it owns"); a file placed
    by role, not by where lines were left."""
    silent = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if path.name == "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(), filename=str(path))) or ""
        if "Owns" not in doc:
            silent.append(str(path.relative_to(ROOT)))
    assert silent == []
