"""LoRA adapters through the real server and the openai SDK: vLLM's flags, adapters
listed in /v1/models with their parent, a request selecting one by `model` (its greedy
tokens transformers + PEFT's), an unknown model's 404, and vLLM's run-time load and unload
routes behind --enable-runtime-lora-updating and --api-key (bad adapters a 400 naming
what is wrong, an unload letting the requests in flight finish); a bad adapter at start
ends the server with the reason in its log."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from server.config import parse_config
from server.lora import LoraModule, parse_lora_modules
from tests.engine.conftest import write_peft_adapter
from tests.server.harness import MODEL_NAME, REPO_ROOT, LiveServer, make_config, serve_in_thread

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

KEY = "sekrit"
PROMPT = [0, 42, 364, 78, 81, 277, 67, 72, 326, 223]


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    options: dict[str, dict[str, object]] = {
        "a": {"rank": 4, "seed": 1},
        "b": {"rank": 8, "seed": 2, "targets": ("gate_proj", "up_proj", "down_proj")},
        "c": {"rank": 2, "seed": 3, "rslora": True},
        "big": {"rank": 32, "seed": 4},
    }
    return {n: write_peft_adapter(tiny_checkpoint, root / n, **o) for n, o in options.items()}  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, adapters: dict[str, Path]) -> Iterator[LiveServer]:
    config = make_config(
        tiny_checkpoint,
        enable_lora=True,
        lora_modules=(
            LoraModule("a", str(adapters["a"])),
            LoraModule("b", str(adapters["b"]), base_model_name="the-base"),
        ),
        max_loras=2,
        max_lora_rank=16,
        enable_runtime_lora_updating=True,
        api_key=KEY,
    )
    with serve_in_thread(config) as live:
        yield live


def peft_greedy(base: Path, adapter: Path, count: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32, attn_implementation="eager"
    )
    model = peft.PeftModel.from_pretrained(model, adapter).eval()
    tokens = list(PROMPT)
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(PROMPT) :]


def greedy_ids(client: OpenAI, model: str, count: int = 8) -> list[int]:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=count, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert out.model == model
    return out.choices[0].token_ids  # type: ignore[attr-defined,no-any-return]


def post(server: LiveServer, path: str, body: object, key: str | None = KEY) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(server.v1 + path, json=body, headers=headers, timeout=60)


def test_adapters_are_models_of_their_own_with_the_base_as_parent(server: LiveServer) -> None:
    client = OpenAI(base_url=server.v1, api_key=KEY)
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [MODEL_NAME, "a", "b"]
    assert cards["a"].parent == MODEL_NAME and cards["b"].parent == "the-base"  # type: ignore[attr-defined]
    assert cards[MODEL_NAME].parent is None  # type: ignore[attr-defined]
    assert client.models.retrieve("b").id == "b"


def test_a_request_naming_an_adapter_gets_peft_s_greedy_tokens(
    server: LiveServer, tiny_checkpoint: Path, adapters: dict[str, Path]
) -> None:
    client = OpenAI(base_url=server.v1, api_key=KEY)
    for name in ("a", "b"):
        assert greedy_ids(client, name) == peft_greedy(tiny_checkpoint, adapters[name], 8)
    assert greedy_ids(client, MODEL_NAME) != greedy_ids(client, "a")
    chat = client.chat.completions.create(
        model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.model == "b" and chat.choices[0].message.content is not None


def test_an_adapter_tokenizes_as_its_base_model(server: LiveServer) -> None:
    def tokenize(model: str) -> httpx.Response:
        body = {"model": model, "prompt": "Hi there"}
        headers = {"Authorization": f"Bearer {KEY}"}
        return httpx.post(server.base_url + "/tokenize", json=body, headers=headers, timeout=30)

    assert tokenize("a").json()["tokens"] == tokenize(MODEL_NAME).json()["tokens"] != []
    assert tokenize("nope").status_code == 404


def test_an_unknown_model_is_openai_s_404(server: LiveServer) -> None:
    client = OpenAI(base_url=server.v1, api_key=KEY)
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert caught.value.body["message"] == "The model `nope` does not exist."  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_run_time_loading_needs_the_key_and_refuses_bad_adapters(
    server: LiveServer, adapters: dict[str, Path], tmp_path: Path
) -> None:
    body = {"lora_name": "c", "lora_path": str(adapters["c"])}
    assert post(server, "/load_lora_adapter", body, key=None).status_code == 401
    bad = [
        ({"lora_name": "x"}, "Both 'lora_name' and 'lora_path' must be provided."),
        ({"lora_name": "x", "lora_path": str(tmp_path / "none")}, "no such folder"),
        ({"lora_name": "x", "lora_path": str(adapters["big"])}, "rank 32 exceeds"),
        ({"lora_name": "a", "lora_path": str(adapters["c"])}, "has already been loaded"),
    ]
    for request, message in bad:
        response = post(server, "/load_lora_adapter", request)
        assert response.status_code == 400, response.text
        assert message in response.json()["error"]["message"]
    missing = post(server, "/unload_lora_adapter", {"lora_name": "x"})
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "The lora adapter 'x' cannot be found."


def test_an_adapter_loaded_at_run_time_serves_and_unloading_lets_requests_finish(
    server: LiveServer, tiny_checkpoint: Path, adapters: dict[str, Path]
) -> None:
    client = OpenAI(base_url=server.v1, api_key=KEY)
    loaded = post(server, "/load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["c"])})
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    assert "c" in [m.id for m in client.models.list().data]
    assert greedy_ids(client, "c") == peft_greedy(tiny_checkpoint, adapters["c"], 8)
    stream = client.completions.create(
        model="c", prompt=PROMPT, max_tokens=40, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    chunks = iter(stream)
    first = next(chunks)
    unloaded = post(server, "/unload_lora_adapter", {"lora_name": "c"})
    assert unloaded.status_code == 200 and "removed successfully" in unloaded.text
    rest = list(chunks)
    tokens = [t for c in [first, *rest] for t in (c.choices[0].token_ids or [])]  # type: ignore[attr-defined]
    assert len(tokens) == 40 and rest[-1].choices[0].finish_reason == "length"
    assert tokens[:8] == peft_greedy(tiny_checkpoint, adapters["c"], 8)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt="hi", max_tokens=2)
    assert "c" not in [m.id for m in client.models.list().data]


def test_the_routes_are_off_by_default(live: LiveServer) -> None:
    response = httpx.post(live.v1 + "/load_lora_adapter", json={"lora_name": "a", "lora_path": "x"})
    assert response.status_code == 404


def test_vllm_s_flags_parse_both_module_forms() -> None:
    config = parse_config(
        ["--model", "m", "--enable-lora", "--lora-modules", "a=/x/a",
         '{"name": "b", "path": "/x/b", "base_model_name": "m"}', "--max-loras", "3",
         "--max-lora-rank", "64", "--max-cpu-loras", "5", "--enable-runtime-lora-updating"],
        environ={},
    )  # fmt: skip
    assert config.lora_modules == (LoraModule("a", "/x/a"), LoraModule("b", "/x/b", "m"))
    assert (config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (3, 64, 5)
    assert config.enable_runtime_lora_updating
    env = {"LLM_SERVER_ENABLE_LORA": "1", "LLM_SERVER_LORA_MODULES": "a=/x/a b=/x/b"}
    assert len(parse_config(["--model", "m"], environ=env).lora_modules) == 2
    for argv, message in [
        (["--lora-modules", "a=/x"], "lora_modules needs enable_lora"),
        (["--enable-lora", "--lora-modules", "nopath"], "name=path or JSON"),
        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "names repeat"),
        (["--enable-lora", "--max-loras", "0"], "max_loras must be >= 1"),
        (["--enable-lora", "--lora-modules", "m=/x"], "served model's name"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_config(["--model", "m", *argv], environ={})
    with pytest.raises(ValueError, match='needs "name" and "path"'):
        parse_lora_modules(['{"name": "a"}'])


def test_a_bad_adapter_at_start_ends_the_server_with_the_reason(
    tiny_checkpoint: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    args = ["--model", str(tiny_checkpoint), "--enable-lora", "--max-lora-rank", "16"]
    args += ["--lora-modules", f"big={adapters['big']}", "--port", "0", "--max-model-len", "64"]
    done = subprocess.run(
        [sys.executable, "-m", "server", *args], cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=240, env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin",
                          "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode != 0
    assert "rank 32 exceeds --max-lora-rank 16" in done.stdout + done.stderr


def lora_info(server: LiveServer) -> dict[str, str]:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("llm_lora_requests_info{")]
    assert len(lines) == 1, lines
    labels = lines[0][lines[0].index("{") + 1 : lines[0].index("}")]
    return dict((k, v.strip('"')) for k, v in (p.split("=", 1) for p in labels.split('",')))


def test_lora_requests_info_is_served_with_the_pool_size(server: LiveServer) -> None:
    """Its labels' contents while adapters run: tests/engine/core/test_lora_slots.py (a
    tiny model's request ends before a scrape could reliably see it running)."""
    client = OpenAI(base_url=server.v1, api_key=KEY)
    client.completions.create(model="a", prompt=PROMPT, max_tokens=4)
    info = lora_info(server)
    assert info == {
        "model_name": MODEL_NAME,
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
        "max_lora": "2",
    }


def test_no_lora_metric_without_lora(live: LiveServer) -> None:
    assert "llm_lora_requests_info" not in httpx.get(live.base_url + "/metrics", timeout=10).text
