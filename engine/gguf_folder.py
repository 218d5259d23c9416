"""A GGUF file served as a checkpoint folder: the small files written once beside a link.

Owns: the prepared folder of one GGUF file under a cache directory: config.json and
generation_config.json from its metadata (engine.gguf), the tokenizer files that
transformers' GGUF conversion writes (vocabulary, merges, special tokens, chat template:
the same ids as `AutoTokenizer.from_pretrained(dir, gguf_file=...)`), and a link to the
file itself with an index of where each tensor's bytes lie, from which
engine.checkpoint dequantizes them at every load (engine.gguf.TensorLoader). Receives the
file's path; emits the folder's. Converting the tokenizer takes seconds, so it is done
once per file (keyed by its path, size and modification time), not at every start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

from engine.gguf import GGUFFile
from engine.types import CheckpointError

logger = logging.getLogger(__name__)

# Bumped when what a prepared folder holds changes, so older folders are not reused.
FORMAT = 2
LINK_NAME = "model.gguf"


def resolve_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one *.gguf of a folder that has
    no config.json; None for anything else (a Hugging Face folder)."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            names = ", ".join(f.name for f in found)
            raise CheckpointError(f"{path}: more than one GGUF file ({names}); name one")
        if found:
            return found[0]
    return None


def folder_key(file: Path) -> str:
    stat = file.stat()
    text = f"{FORMAT}:{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prepare_folder(file: Path, cache_root: Path) -> Path:
    """The checkpoint folder serving GGUF `file`, written under `cache_root` on first use.

    Reads the whole header (a CheckpointError for an unreadable or truncated file, an
    architecture or tensor type the engine does not serve) before anything is written;
    the folder appears whole or not at all."""
    file = file.resolve()
    folder = cache_root / f"{file.stem}-{folder_key(file)}"
    if (folder / "config.json").is_file():
        return folder
    gguf = GGUFFile(file)
    config = gguf.hf_config()
    logger.info("preparing GGUF checkpoint folder", extra={"path": str(folder)})
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _write_tokenizer(file, tmp)
    (tmp / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    generation = json.dumps(gguf.generation_config(), indent=2)
    (tmp / "generation_config.json").write_text(generation, encoding="utf-8")
    (tmp / LINK_NAME).symlink_to(file)
    gguf.write_index(tmp, LINK_NAME)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.replace(folder)
    return folder


def _write_tokenizer(file: Path, folder: Path) -> None:
    """transformers' conversion of the file's tokenizer, saved as tokenizer.json & co."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(file.parent), gguf_file=file.name, local_files_only=True
        )
    except Exception as exc:  # the conversion raises whatever its tokenizer model meets
        raise CheckpointError(f"{file}: cannot convert its tokenizer ({exc})") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise CheckpointError(f"{file}: its tokenizer did not convert to a fast tokenizer")
    tokenizer.save_pretrained(str(folder))
