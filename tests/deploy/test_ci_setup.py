"""deploy/ci-setup.sh is idempotent: with its tools present it changes nothing, fast."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "ci-setup.sh"


def test_ci_setup_is_quick_when_tools_are_present() -> None:
    done = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr
    assert shutil.which("kubectl") is not None
    assert shutil.which("nginx") or Path("/usr/sbin/nginx").exists()
    # A second run finds everything in place and installs nothing.
    started = time.monotonic()
    again = subprocess.run(
        ["bash", "-x", str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False
    )
    assert again.returncode == 0, again.stderr
    assert "apt-get" not in again.stderr and "pip install" not in again.stderr
    assert time.monotonic() - started < 10
