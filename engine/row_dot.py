"""XLA:CPU's batch-invariant fast product: rows (M, K) times weights (N, K)^T, float32 or
bfloat16, summed in float32.

Owns: building the engine's C++ kernels into shared libraries (`load`: once per source,
jaxlib and processor; kept in the kernel cache folder) and registering them with XLA as
FFI targets (this module's engine/row_dot.cc; engine.attention.cpu_kernel's too), and
`row_dot`, the call, with `pack` (the packed layout) and `packed_rows`. Receives
rows and weights as the checkpoint stores them (out, in), both float32 or both bfloat16,
or weights packed; emits float32 (M, N).

Why: XLA:CPU's own product takes other kernels by row count. One row goes through a
matrix-vector kernel that reads the weights once; two or more through a blocked product
that packs the weights on every call, 2-3x slower at the few rows of a decode step
(bench/README, "CPU products"), and rounding otherwise than the one-row kernel. The
engine padded every step to 8 rows so a sequence kept its bits alone and in a batch,
and so paid the blocked product's price at every step (with this kernel, a sequence
alone runs a 2-token program: engine.core.shapes). This kernel sums each output
element in one order whatever the row count (the .cc file says how), so a row's bits
are its own at any row count, and at a few rows it is one pass over the weights.

bfloat16: XLA:CPU's product of one bfloat16 row ran at ~1 GB/s of weights here (171 ms
for SmolLM2's layers against 15 ms in float32: a bfloat16 model decoded 4-12x slower than
float32). The kernel's bfloat16 form uses AVX512-BF16's pair products where the processor
has them (`bf16_native`), at half float32's bytes and twice its products an instruction.
There, and in float32 wherever the kernel runs, the engine stores its layer weights and
head `pack`ed (16 outputs' k values, or k pairs, side by side,
engine.paged_model.packed_products): a row's value is broadcast to 16 outputs at once,
each summing in one lane, with no tree to finish an output: SmolLM2's layer products
1.1-1.8x faster than the lane form's at 1-128 rows in bfloat16, 1.2-2.2x in float32
(bench/README).

`available()` says whether the kernel can run here (a C++ compiler and XLA's FFI headers
from jaxlib, on a CPU backend); where it cannot, the model keeps XLA's product (the
reference, engine.model.project), and ModelConfig.row_products stays off. `serves(dtype)`
says whether a dtype's products go through it (bfloat16 only where native).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
from jaxlib.version import __version__ as jaxlib_version

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("row_dot.cc")
# included by every kernel source (relative to it): a change to it is a new library
HEADER = Path(__file__).with_name("cpu_kernel.h")
TARGET = "jax_llm_server_row_dot_f32"
LAYER_TARGET = "jax_llm_server_row_dot_layer_f32"
BF16_TARGET = "jax_llm_server_row_dot_bf16"
BF16_LAYER_TARGET = "jax_llm_server_row_dot_layer_bf16"
PACKED_TARGET = "jax_llm_server_row_dot_packed_f32"
BF16_PACKED_TARGET = "jax_llm_server_row_dot_packed_bf16"
PACKED_OUTPUTS = 16  # outputs a packed vector holds (the .cc file's packed::kOutputs)
FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-funroll-loops", "-ffp-contract=off")
FLAGS += ("-std=c++17", "-shared", "-fPIC", "-w")

_lock = threading.Lock()
_state: dict[str, bool] = {}  # per source: the outcome of its first build and registration


def kernel_dir() -> Path:
    """Beside the compile cache when there is one (its folder's parent), else the user's
    cache folder: where the built library is kept across processes."""
    compile_cache = getattr(jax.config, "jax_compilation_cache_dir", None)
    if compile_cache:
        return Path(compile_cache).parent / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jax-llm-server" / "kernels"


def _include_dir() -> Path:
    import jaxlib

    return Path(jaxlib.__file__).parent / "include"


def _library_path(folder: Path, source: Path) -> Path:
    """A name that changes with the source, jaxlib, the flags and the processor."""
    key = hashlib.sha256()
    key.update(source.read_bytes())
    key.update(HEADER.read_bytes())
    key.update(jaxlib_version.encode())
    key.update(" ".join(FLAGS).encode())
    key.update(platform.machine().encode())
    key.update(_cpu_flags().encode())
    return folder / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _cpu_flags() -> str:
    """The processor's feature flags (-march=native builds for them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build(folder: Path, source: Path = SOURCE) -> Path:
    """The library for `source`, jaxlib and processor, compiled into `folder` unless it
    is there already (written under a temporary name, then renamed: concurrent builds
    are safe). Raises RuntimeError when it cannot be built."""
    target = _library_path(folder, source)
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++ or g++, or CXX)")
    if not (_include_dir() / "xla" / "ffi" / "api" / "ffi.h").exists():
        raise RuntimeError(f"jaxlib has no FFI headers in {_include_dir()}")
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    command = [compiler, *FLAGS, f"-I{_include_dir()}", str(source), "-o", tmp]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
    os.replace(tmp, target)
    return target


def load(source: Path, targets: dict[str, str]) -> bool:
    """Whether `source`'s kernels can run in this process: its library built (or found)
    and each of its symbols registered with XLA as the FFI target named, once per source.
    Logs why not, once, when they cannot."""
    with _lock:
        if str(source) not in _state:
            try:
                library = ctypes.cdll.LoadLibrary(str(build(kernel_dir(), source)))
                for name, symbol in targets.items():
                    handler = jax.ffi.pycapsule(getattr(library, symbol))
                    jax.ffi.register_ffi_target(name, handler, platform="cpu")
                _state[str(source)] = True
            except (OSError, RuntimeError) as error:
                log.warning("kernel %s unavailable, XLA's form used: %s", source.name, error)
                _state[str(source)] = False
        return _state[str(source)]


def available() -> bool:
    """Whether `row_dot` can run in this process (`load`)."""
    targets = {TARGET: "RowDotF32", LAYER_TARGET: "RowDotLayerF32"}
    targets |= {BF16_TARGET: "RowDotBf16", BF16_LAYER_TARGET: "RowDotLayerBf16"}
    targets |= {PACKED_TARGET: "RowDotPackedLayerF32"}
    targets |= {BF16_PACKED_TARGET: "RowDotPackedLayerBf16"}
    return load(SOURCE, targets)


def bf16_native() -> bool:
    """Whether the bfloat16 product runs on the processor's AVX512-BF16 dot products here
    (without them the kernel emulates the instruction, far slower than XLA's product)."""
    with _lock:
        if "bf16_native" not in _state:
            try:
                library = ctypes.cdll.LoadLibrary(str(build(kernel_dir(), SOURCE)))
                _state["bf16_native"] = bool(library.RowDotBf16Native())
            except (OSError, RuntimeError):
                _state["bf16_native"] = False
    return available() and _state["bf16_native"]


def serves(dtype: jnp.dtype | str) -> bool:
    """Whether the engine's products in `dtype` (rows and weights alike) go through the
    kernel here: float32 wherever it builds, bfloat16 where it is native."""
    name = jnp.dtype(dtype).name
    return (name == "float32" and available()) or (name == "bfloat16" and bf16_native())


def packs(w: jax.Array | jax.ShapeDtypeStruct) -> bool:
    """Whether stacked weights w (L, N, K) are served `pack`ed here: float32 wherever the
    kernel runs, bfloat16 on the processor's dot products (`bf16_native`, K in pairs);
    16 outputs to a vector (N % 16 == 0). The packed form's step holds 16 outputs of one
    row, where the lane form's holds a vector of k of one output: bfloat16 runs at ~1.4x
    the lane form's speed at K = 576 (bench/README, "Packed bfloat16 weights")."""
    if len(w.shape) != 3 or w.shape[1] % PACKED_OUTPUTS != 0:
        return False
    if w.dtype == jnp.float32:
        return available()
    return w.dtype == jnp.bfloat16 and w.shape[2] % 2 == 0 and bf16_native()


def _per_step(dtype: jnp.dtype) -> int:
    """k a packed step takes: the values in 32 bits (1 float32, a bfloat16 pair)."""
    return 4 // jnp.dtype(dtype).itemsize


def pack(w: jax.Array) -> jax.Array:
    """Stacked weights (L, N, K) in the packed kernel's layout (L, N / 16, K / P, 16 P),
    P = 1 for float32 and 2 for bfloat16: per 16 outputs, each step's 16 (w[n, P j], ...,
    w[n, P j + P - 1]) side by side (`packs` first)."""
    layers, n, k = w.shape
    per = _per_step(w.dtype)
    blocks = w.reshape(layers, n // PACKED_OUTPUTS, PACKED_OUTPUTS, k // per, per)
    return blocks.transpose(0, 1, 3, 2, 4).reshape(
        layers, n // PACKED_OUTPUTS, k // per, PACKED_OUTPUTS * per
    )


def packed_rows(w: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows `ids` of the first layer of a `pack`ed stack, as stored before packing (T, K):
    a tied embedding read from its packed head."""
    per = _per_step(w.dtype)
    blocks = w[0].reshape(w.shape[1], w.shape[2], PACKED_OUTPUTS, per)
    rows = blocks[ids // PACKED_OUTPUTS, :, ids % PACKED_OUTPUTS, :]  # (T, K / P, P)
    return rows.reshape(*ids.shape, per * w.shape[2])


def row_dot(
    x: jax.Array, w: jax.Array, layer: jax.Array | None = None, live: jax.Array | None = None
) -> jax.Array:
    """x (M, K) times w (N, K)^T, both float32 or both bfloat16 -> (M, N) float32;
    `available()` first (bfloat16: `bf16_native()` for speed; the module's .cc file says
    how each is summed).
    With `layer` (an int32 scalar), w is a stack (L, N, K) and its layer `layer` is read
    in place (a slice of it as an operand would be copied out first, every step).
    `live` (an int32 scalar): rows from it on are padding, zeros at no cost (all M rows
    are live without it). A `pack`ed stack (L, N / 16, K / 2, 32), with `layer`, goes
    through the packed kernel."""
    if x.dtype != w.dtype or x.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(
            f"row_dot takes float32 or bfloat16 rows and weights, got {x.dtype}, {w.dtype}"
        )
    bf16 = x.dtype == jnp.bfloat16
    rows = jnp.asarray(x.shape[0] if live is None else live, jnp.int32).reshape(1)
    if w.ndim == 4:
        if layer is None:
            raise TypeError("packed weights are stacks, read with a layer index")
        out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1] * PACKED_OUTPUTS), jnp.float32)
        target = BF16_PACKED_TARGET if bf16 else PACKED_TARGET
        return jax.ffi.ffi_call(target, out)(x, w, jnp.asarray(layer, jnp.int32), rows)
    if layer is None:
        out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
        return jax.ffi.ffi_call(BF16_TARGET if bf16 else TARGET, out)(x, w, rows)
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    target = BF16_LAYER_TARGET if bf16 else LAYER_TARGET
    return jax.ffi.ffi_call(target, out)(x, w, jnp.asarray(layer, jnp.int32), rows)
