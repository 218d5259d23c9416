"""ServerConfig from flags and LLM_SERVER_* variables: flag beats env beats default."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.config import ServerConfig, parse_config


def test_defaults() -> None:
    config = parse_config([], environ={})
    assert (config.host, config.port) == ("0.0.0.0", 8000)
    assert config.model is None and config.model_name == "smollm2-135m-instruct"
    assert config.drain_timeout == 30.0 and config.sse_ping_interval == 15.0
    assert config.log_format == "json" and config.api_key is None
    assert config.cache_dir == Path.home() / ".cache" / "jax-llm-server"


def test_flag_beats_env_beats_default(tmp_path: Path) -> None:
    env = {"LLM_SERVER_PORT": "9001", "LLM_SERVER_MAX_NUM_SEQS": "3", "LLM_SERVER_API_KEY": "k1"}
    config = parse_config(["--port", "9002"], environ=env)
    assert config.port == 9002
    assert config.max_num_seqs == 3
    assert config.api_key == "k1"


def test_max_slots_is_read_as_max_num_seqs() -> None:
    """The flag's older name (and its variable) still configure it; the new name wins."""
    assert parse_config(["--max-slots", "3"], environ={}).max_num_seqs == 3
    assert parse_config([], environ={"LLM_SERVER_MAX_SLOTS": "5"}).max_num_seqs == 5
    both = parse_config(["--max-slots", "3", "--max-num-seqs", "7"], environ={})
    assert both.max_num_seqs == 7


def test_every_listed_flag_parses(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    config = parse_config(
        [
            "--model", str(tmp_path), "--served-model-name", "m", "--host", "127.0.0.1",
            "--port", "1234", "--max-num-seqs", "2", "--max-model-len", "256",
            "--max-num-batched-tokens", "128", "--page-size", "8", "--prefill-chunk", "64",
            "--prefill-chunk-beside-decode", "16",
            "--prefix-caching", "false", "--async-scheduling", "false",
            "--gpu-memory-utilization", "0.5", "--dtype", "bfloat16",
            "--max-queued-samples", "5", "--api-key", "secret", "--log-level", "debug",
            "--log-format", "text", "--chat-template", str(template), "--drain-timeout", "2.5",
            "--sse-ping-interval", "3", "--max-request-bytes", "2048",
            "--cache-dir", str(tmp_path / "cache"),
        ],
        environ={},
    )  # fmt: skip
    assert config == ServerConfig(
        model=tmp_path,
        served_model_name="m",
        host="127.0.0.1",
        port=1234,
        max_num_seqs=2,
        max_model_len=256,
        max_num_batched_tokens=128,
        page_size=8,
        prefill_chunk=64,
        prefill_chunk_beside_decode=16,
        prefix_caching=False,
        async_scheduling=False,
        gpu_memory_utilization=0.5,
        dtype="bfloat16",
        max_queued_samples=5,
        api_key="secret",
        log_level="debug",
        log_format="text",
        chat_template=template,
        drain_timeout=2.5,
        sse_ping_interval=3.0,
        max_request_bytes=2048,
        cache_dir=tmp_path / "cache",
    )
    assert config.model_name == "m"
    assert config.core_config(str(tmp_path)).decode_chunk_size == 16


def test_cache_dir_follows_xdg(tmp_path: Path) -> None:
    config = parse_config([], environ={"XDG_CACHE_HOME": str(tmp_path)})
    assert config.resolved_cache_dir == tmp_path / "jax-llm-server"


def test_model_demo_names_the_demo_and_a_folder_named_demo_is_a_path(tmp_path: Path) -> None:
    demo = parse_config(["--model", "demo"], environ={})
    assert demo.model == Path("demo") and demo.model_name == "demo-model"
    folder = parse_config(["--model", "./demo"], environ={})
    assert folder.model == Path.cwd() / "demo" and folder.model_name == "demo"
    gguf = parse_config(["--model", str(tmp_path / "m.Q4_1.gguf")], environ={})
    assert gguf.model_name == "m.Q4_1.gguf"


def test_fault_injection_from_env() -> None:
    config = parse_config([], environ={"LLM_SERVER_FAULT_INJECTION": "core:after=3"})
    assert config.fault_injection == "core:after=3"


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--port", "abc"], {}, "--port"),
        ([], {"LLM_SERVER_PORT": "70000"}, "port"),
        (["--max-num-seqs", "0"], {}, "max_num_seqs"),
        (["--max-slots", "0"], {}, "max_num_seqs"),
        (["--dtype", "float16"], {}, "dtype"),
        (["--prefill-chunk", "8"], {}, "prefill_chunk must be at least page_size"),
        (["--prefill-chunk-beside-decode", "8"], {}, "prefill_chunk_beside_decode must be"),
        (["--gpu-memory-utilization", "1.5"], {}, "gpu_memory_utilization"),
        (["--fault-injection", "everywhere"], {}, "fault_injection"),
        (["--log-format", "xml"], {}, "log_format"),
        (["--drain-timeout", "-1"], {}, "drain_timeout"),
        (["--prefix-caching", "maybe"], {}, "--prefix-caching"),
        ([], {"LLM_SERVER_MAX_MODEL_LEN": "1"}, "max_model_len"),
        (["--tool-call-parser", "mistral"], {}, "tool_call_parser must be one of hermes"),
        (["--enable-auto-tool-choice"], {}, "needs tool_call_parser"),
        (["--enable-auto-tool-choice", "maybe"], {}, "--enable-auto-tool-choice"),
    ],
)
def test_bad_values_raise_value_error_naming_them(
    argv: list[str], env: dict[str, str], needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_config(argv, environ=env)


def test_empty_variables_count_as_unset() -> None:
    """`docker run -e LLM_SERVER_MODEL=` serves the demo model; empty numbers are defaults."""
    env = {"LLM_SERVER_MODEL": "", "LLM_SERVER_PORT": "", "LLM_SERVER_API_KEY": ""}
    config = parse_config([], environ=env)
    assert (config.model, config.port, config.api_key) == (None, 8000, None)


def test_tool_flags_as_vllm_spells_them() -> None:
    """`--enable-auto-tool-choice` alone switches it on; the variable says true or false."""
    config = parse_config(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], {})
    assert config.enable_auto_tool_choice and config.tool_call_parser == "hermes"
    env = {"LLM_SERVER_ENABLE_AUTO_TOOL_CHOICE": "false", "LLM_SERVER_TOOL_CALL_PARSER": "hermes"}
    config = parse_config([], environ=env)
    assert not config.enable_auto_tool_choice and config.tool_call_parser == "hermes"
    assert not parse_config([], environ={}).enable_auto_tool_choice


def test_a_step_takes_a_whole_chunk_beside_every_decode_row_by_default() -> None:
    assert ServerConfig().batched_tokens is None  # the backend's chunk: engine.core.core
    assert ServerConfig(max_num_seqs=32, prefill_chunk=128).batched_tokens == 160
    assert ServerConfig(max_num_batched_tokens=2048).batched_tokens == 2048
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        ServerConfig(max_num_batched_tokens=0)
