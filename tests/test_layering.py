"""Imports flow one way: server -> engine -> tokenization, and the model code stays pure."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# package -> top-level packages it must never import
FORBIDDEN = {
    "tokenization": {"engine", "server"},
    "engine": {"server", "prometheus_client", "prometheus_fastapi_instrumentator", "fastapi"},
}
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


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


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


@pytest.mark.parametrize("module", PURE_MODULES)
def test_model_code_is_pure(module: str) -> None:
    path = ROOT / module
    assert path.exists(), f"{module} is missing"
    assert sorted(imported_roots(path) & PURE_FORBIDDEN) == []


def test_no_engine_module_runs_past_500_lines() -> None:
    """The engine-core issue's bound: each module owns one thing, a few hundred lines."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "engine").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long
