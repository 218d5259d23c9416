"""Flags of scale-out and start-up: devices, processes, the compile cache; each misuse a
clear error at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.config import parse_config
from tests.server.harness import REPO_ROOT


def test_device_and_process_flags_parse() -> None:
    config = parse_config(
        ["--tensor-parallel-size", "2", "--prefill-devices", "0-1", "--generate-devices", "2,3"],
        environ={},
    )
    assert (config.tensor_parallel_size, config.prefill_devices) == (2, "0-1")
    env = {
        "LLM_SERVER_COORDINATOR_ADDRESS": "10.0.0.1:8482",
        "LLM_SERVER_NUM_PROCESSES": "4",
        "LLM_SERVER_PROCESS_ID": "3",
        "LLM_SERVER_DISTRIBUTED_TIMEOUT": "60",
    }
    config = parse_config([], environ=env)
    assert (config.num_processes, config.process_id, config.distributed_timeout) == (4, 3, 60)


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--tensor-parallel-size", "0"], "tensor_parallel_size must be >= 1"),
        (["--prefill-devices", "0"], "go together"),
        (["--num-processes", "2"], "needs coordinator_address"),
        (["--num-processes", "2", "--coordinator-address", "h:1"], "and process_id"),
        (["--num-processes", "2", "--process-id", "2"], "process_id must be in 0..1"),
        (
            ["--num-processes", "2", "--process-id", "0", "--coordinator-address", "h:1",
             "--prefill-devices", "0", "--generate-devices", "1"],
            "not disaggregated",
        ),
        (["--distributed-timeout", "0"], "distributed_timeout must be > 0"),
        (
            ["--prefill-devices", "1", "--generate-devices", "1", "--speculative-config",
             '{"method": "ngram", "num_speculative_tokens": 2}'],
            "does not combine with prefill_devices",
        ),
    ],
)  # fmt: skip
def test_misconfiguration_is_a_clear_error(argv: list[str], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_config(argv, environ={})


COMPILE = """
import json, sys
from pathlib import Path
import jax, jax.numpy as jnp
from server.config import parse_config
from server.loading import enable_compile_cache
used = enable_compile_cache(parse_config(sys.argv[1:], environ={}))
jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))).block_until_ready()
print(json.dumps(None if used is None else str(used)))
"""


def compile_once(args: list[str], **env: str) -> str | None:
    base = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    run = subprocess.run(
        [sys.executable, "-c", COMPILE, *args],
        env={**base, "PYTHONPATH": str(REPO_ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_compiled_programs_are_kept_under_the_cache_dir(tmp_path: Path) -> None:
    used = compile_once(["--cache-dir", str(tmp_path)])
    assert used == str(tmp_path / "jax")
    assert any((tmp_path / "jax").iterdir())  # what a restart reads back
    mine = tmp_path / "elsewhere"
    assert compile_once(["--cache-dir", str(tmp_path)], JAX_COMPILATION_CACHE_DIR=str(mine)) == (
        str(mine)
    )
    assert compile_once(["--cache-dir", str(tmp_path / "off"), "--compile-cache", "false"]) is None
    assert not (tmp_path / "off" / "jax").exists()
