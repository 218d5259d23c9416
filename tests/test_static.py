"""Static checks run with the tests, so CI's one test command holds the code to them.

ruff (lint and format, configured in pyproject.toml) over the tree, and mypy over
the four packages.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["server", "frontend", "engine", "tokenization"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("command", [("check", "."), ("format", "--check", ".")])
def test_ruff(command: tuple[str, ...]) -> None:
    done = run("ruff", *command)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy() -> None:
    done = run("mypy", *PACKAGES)
    assert done.returncode == 0, done.stdout + done.stderr
