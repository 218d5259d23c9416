"""XLA flags per backend, set before jax starts its backends: the one place they live.

Owns: BACKEND_XLA_FLAGS (platform -> flags) and `set_backend_flags`, which the engine
core's process (engine.core.process) and the GPU benchmarks (bench.gpu_decode,
bench.gpu_check) call before their first jax computation. Receives the process
environment (a mapping; read, and XLA_FLAGS written); emits the platform it expects jax
to pick and the XLA_FLAGS it leaves there. XLA reads XLA_FLAGS once, when the first
backend starts, so a flag set later does nothing.

GPU: one launch a step. XLA records a step's thunks into command buffers (CUDA graphs)
and replays them: by default fusions, cuBLAS / cuBLASLt, custom calls (the Pallas
attention kernel, engine.attention.gpu_kernel) and cuDNN, in runs of 5 or more. The step
program also holds conditionals (lax.cond / switch: logprobs only when a row asks,
engine.logprobs) and while loops (lax.fori_loop); without them in the graph every one
splits it and costs a host round trip. So: `+WHILE,+CONDITIONAL` on top of XLA's
default set (CUDA conditional graph nodes), and a minimum graph size of 1 so short runs
between them are captured too. The cost is at warm-up: each executable records its
graph on its first run (and XLA keeps a few traced graphs per executable,
xla_cmd_buffer_trace_cache_size); steady steps replay it. The time it saves per step
is what bench.gpu_decode measures (figures in bench/README.md, "One H200", once taken).
A flag the user already put in XLA_FLAGS is left as given.

The same call sets the GPU allocator's share of the device (XLA_PYTHON_CLIENT_MEM_FRACTION,
engine.core.defaults), unless the environment already names one.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, MutableMapping

from engine.core.defaults import defaults_for

BACKEND_XLA_FLAGS: dict[str, tuple[str, ...]] = {
    "gpu": (
        "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
        "--xla_gpu_graph_min_graph_size=1",
    ),
    "cpu": (),
    "tpu": (),
}
# JAX_PLATFORMS names -> the platform a device reports
_PLATFORM_NAMES = {"cuda": "gpu", "gpu": "gpu", "rocm": "gpu", "tpu": "tpu", "cpu": "cpu"}
_GPU_PLUGINS = (
    "jax_cuda13_plugin",
    "jax_cuda12_plugin",
    "jax_plugins.xla_cuda13",
    "jax_plugins.xla_cuda12",
)
_TPU_PLUGINS = ("libtpu",)


def _installed(modules: tuple[str, ...]) -> bool:
    for name in modules:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # a dotted name whose parent is absent
            continue
    return False


def expected_platform(environ: Mapping[str, str]) -> str:
    """The platform jax will pick, known without starting it: JAX_PLATFORMS' first entry,
    else a GPU plugin's or libtpu's presence, else CPU."""
    chosen = environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if chosen:
        return _PLATFORM_NAMES.get(chosen, chosen)
    if _installed(_GPU_PLUGINS):
        return "gpu"
    if _installed(_TPU_PLUGINS):
        return "tpu"
    return "cpu"


def with_backend_flags(xla_flags: str, platform: str) -> str:
    """XLA_FLAGS with the platform's flags added, except those already named in it."""
    given = {part.split("=")[0] for part in xla_flags.split()}
    extra = [f for f in BACKEND_XLA_FLAGS.get(platform, ()) if f.split("=")[0] not in given]
    return " ".join([*xla_flags.split(), *extra])


MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def set_backend_flags(environ: MutableMapping[str, str]) -> str:
    """Put the expected platform's flags in environ["XLA_FLAGS"] and its allocator share
    in XLA_PYTHON_CLIENT_MEM_FRACTION (where it has one and none is set); returns the
    platform."""
    platform = expected_platform(environ)
    flags = with_backend_flags(environ.get("XLA_FLAGS", ""), platform)
    if flags:
        environ["XLA_FLAGS"] = flags
    fraction = defaults_for(platform).allocator_fraction
    if fraction is not None and MEM_FRACTION not in environ:
        environ[MEM_FRACTION] = f"{fraction:.2f}"
    return platform
