"""engine.xla_flags: command buffers (CUDA graphs) for GPU only, the user's flags kept,
the platform known before jax starts, and XLA accepting the flags we set."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine import xla_flags
from engine.xla_flags import (
    BACKEND_XLA_FLAGS,
    expected_platform,
    set_backend_flags,
    with_backend_flags,
)


@pytest.mark.parametrize("name", ["cuda", "gpu", "cuda,cpu"])
def test_gpu_gets_command_buffer_flags(name: str) -> None:
    environ = {"JAX_PLATFORMS": name}
    assert set_backend_flags(environ) == "gpu"
    flags = environ["XLA_FLAGS"].split()
    assert "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" in flags
    assert "--xla_gpu_graph_min_graph_size=1" in flags
    assert environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.90"  # engine.core.defaults


def test_an_allocator_share_the_user_gave_is_kept() -> None:
    environ = {"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    set_backend_flags(environ)
    assert environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"


@pytest.mark.parametrize("name", ["cpu", "tpu"])
def test_cpu_and_tpu_get_none(name: str) -> None:
    environ = {"JAX_PLATFORMS": name, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert set_backend_flags(environ) == name
    assert environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    bare = {"JAX_PLATFORMS": name}
    set_backend_flags(bare)
    assert bare == {"JAX_PLATFORMS": name}  # neither flags nor an allocator share


def test_a_flag_the_user_gave_is_kept() -> None:
    given = "--xla_gpu_graph_min_graph_size=5 --xla_dump_to=out"
    flags = with_backend_flags(given, "gpu").split()
    assert "--xla_gpu_graph_min_graph_size=5" in flags and "--xla_dump_to=out" in flags
    assert "--xla_gpu_graph_min_graph_size=1" not in flags
    assert "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" in flags


def test_platform_from_installed_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    installed: set[str] = set()
    monkeypatch.setattr(xla_flags, "_installed", lambda names: bool(installed & set(names)))
    assert expected_platform({}) == "cpu"
    installed.add("libtpu")
    assert expected_platform({}) == "tpu"
    installed.add("jax_cuda13_plugin")
    assert expected_platform({}) == "gpu"
    assert expected_platform({"JAX_PLATFORMS": "cpu"}) == "cpu"  # the user's choice wins


def test_xla_accepts_the_gpu_flags() -> None:
    """XLA parses every XLA_FLAGS entry when a backend starts and dies on an unknown flag
    or command type: a CPU process given the GPU flags must still compute."""
    flags = " ".join(BACKEND_XLA_FLAGS["gpu"])
    code = "import jax, jax.numpy as jnp; print(float(jax.jit(lambda x: x + 1)(jnp.ones(()))))"
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, "PATH": ""}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "2.0"
