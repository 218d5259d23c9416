"""Shared test set-up: JAX on the CPU with a persistent compile cache, and tiny checkpoints.

Checkpoints are written at run time into a temp folder by engine.tiny, so a fresh
clone needs nothing but the package and its test extra.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Four CPU devices, for the tensor-parallel and disaggregated tests; the others use one.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    os.environ["XLA_FLAGS"] = flags.strip()
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(Path.home() / ".cache" / "jax-llm-server-tests")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint with a trained byte-level BPE tokenizer and chat template."""
    from engine.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test module, drop what its engines compiled.

    Every loaded XLA:CPU executable holds memory mappings; one pytest process that keeps
    the programs of every engine it ever built runs into the kernel's limit on mappings
    per process (vm.max_map_count, 65,530 by default) and XLA crashes on the next
    executable it loads. The HTTP tests share one in-process server for the session
    (tests/server/conftest.py), whose programs must stay: there only garbage goes.
    """
    yield
    gc.collect()
    jax = sys.modules.get("jax")
    if jax is not None and "server" not in Path(str(request.path)).parent.parts:
        jax.clear_caches()
