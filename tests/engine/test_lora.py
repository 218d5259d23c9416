"""engine.lora on the real tiny model: an adapter's logits through the engine core match
transformers + PEFT on the same base and adapter (adapters PEFT itself writes, any of the
seven projections, ranks below the pool's, lora_alpha and rslora scaling), and bad
adapter folders are refused naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from engine.config import load_model_config
from engine.core.core import CoreConfig, EngineCore
from engine.core.scheduler import Emitted, SequenceState
from engine.lora import read_adapter
from engine.types import SamplingParams
from tests.engine.conftest import core_of, run_core

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOL = 1e-4  # float32, as tests/engine/core/test_parity.py
GREEDY = SamplingParams(temperature=0.0, seed=0, logprobs=5)
PROMPT = [0, 42, 364, 78, 81, 277, 67, 72, 326, 223, 163, 124, 257, 502, 315, 249, 225, 40]
MLP = ("gate_proj", "up_proj", "down_proj")
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", *MLP)


def peft_logprobs(base: Path, adapter: Path, tokens: list[int]) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32, attn_implementation="eager"
    )
    model = peft.PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def generate(core: EngineCore, adapter: str | None, count: int = 8) -> list[Emitted]:
    assert core.adapters is not None
    seq = SequenceState("s", tuple(PROMPT), GREEDY, count, prompt_logprobs=5)
    seq.adapter = 0 if adapter is None else core.adapters.by_name[adapter]
    return run_core(core, [seq])["s"]


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("llama", {"rank": 4, "alpha": 8.0}),
        ("llama", {"rank": 8, "alpha": 4.0, "targets": MLP, "rslora": True}),
        ("qwen2", {"rank": 2, "alpha": 16.0, "targets": ALL}),
        ("mistral", {"rank": 3, "alpha": 6.0, "targets": ("q_proj", "v_proj", "down_proj")}),
    ],
)
def test_logits_with_an_adapter_match_transformers_and_peft(
    arch, options, tiny_checkpoint_of, peft_adapter_of
):
    base, adapter = tiny_checkpoint_of(arch), peft_adapter_of(arch, **options)
    core = core_of(base, max_loras=2, max_lora_rank=8, lora_modules=(("a", str(adapter)),))
    events = generate(core, "a")
    check_against_peft(base, adapter, events)
    # the adapter changes the model: the base's logprobs are elsewhere
    base_events = generate(core, None)
    assert any(abs(a.logprob - b.logprob) > 1e-3 for a, b in zip(events, base_events, strict=True))


def check_against_peft(base: Path, adapter: Path, events: list[Emitted]) -> None:
    tokens = PROMPT + [e.token for e in events]
    want = peft_logprobs(base, adapter, tokens[:-1])
    n = len(PROMPT)
    assert [e.token for e in events] == [int(np.argmax(want[n - 1 + i])) for i in range(8)]
    entries = events[0].prompt_logprobs
    assert entries is not None
    got = [e.logprob for e in entries[1:]]  # type: ignore[union-attr]
    np.testing.assert_allclose(got, [want[p - 1, PROMPT[p]] for p in range(1, n)], atol=TOL)
    for i, event in enumerate(events):
        np.testing.assert_allclose(event.logprob, want[n - 1 + i, event.token], atol=TOL)


@pytest.mark.parametrize(("arch", "tp"), [("llama", 2), ("llama", 4), ("qwen2", 2)])
def test_adapters_shard_with_their_layers(arch, tp, tiny_checkpoint_of, peft_adapter_of):
    """Tensor parallel (4 CPU devices; on 4 the llama's 2 kv heads are replicated): the
    pool split as its weights are, and the logits still PEFT's."""
    base, adapter = tiny_checkpoint_of(arch), peft_adapter_of(arch, rank=3, targets=ALL)
    core = core_of(
        base, tensor_parallel_size=tp, max_loras=2, max_lora_rank=4,
        lora_modules=(("a", str(adapter)),),
    )  # fmt: skip
    check_against_peft(base, adapter, generate(core, "a"))
    layer = core.runner.params["layers"]  # every layer's, stacked on a leading axis
    split = {"lora_b_wqkv": 3, "lora_b_w_gate_up": 3, "lora_a_wo": 2, "lora_a_w_down": 2}
    for name, axis in split.items():
        array = layer[name]
        assert array.sharding.spec[axis] == "model", name
        assert all(s.data.shape[axis] * tp == array.shape[axis] for s in array.addressable_shards)
    for name in ("lora_a_wqkv", "lora_b_wo", "lora_a_w_gate_up", "lora_b_w_down"):
        assert all(s.data.shape == layer[name].shape for s in layer[name].addressable_shards)


def test_a_core_with_a_pool_serves_the_base_model_with_the_same_bits(tiny_checkpoint_of):
    base = tiny_checkpoint_of("llama")
    plain = generate_plain(core_of(base))
    pooled = core_of(base, max_loras=2)
    assert [(e.token, e.logprob) for e in generate(pooled, None)] == plain


def generate_plain(core: EngineCore) -> list[tuple[int, float]]:
    seq = SequenceState("s", tuple(PROMPT), GREEDY, 8, prompt_logprobs=5)
    return [(e.token, e.logprob) for e in run_core(core, [seq])["s"]]


def _copy(adapter: Path, to: Path) -> Path:
    shutil.copytree(adapter, to)
    return to


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


@pytest.mark.parametrize(
    ("breaks", "message"),
    [
        (lambda f: (f / "adapter_config.json").unlink(), "no adapter_config.json"),
        (lambda f: (f / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
        (lambda f: (f / "adapter_config.json").write_text("{"), "malformed adapter_config.json"),
        (lambda f: (f / "adapter_model.safetensors").write_bytes(b"junk"), "unreadable"),
        (lambda f: _edit_config(f, r=32), "rank 32 exceeds --max-lora-rank 16"),
        (lambda f: _edit_config(f, target_modules=["embed_tokens"]), "not supported"),
        (lambda f: _edit_config(f, target_modules="all-linear"), "must be a list"),
        (lambda f: _edit_config(f, use_dora=True), "use_dora"),
        (lambda f: _edit_config(f, target_modules=["q_proj", "gate_proj"]), "missing tensor"),
    ],
)
def test_a_bad_adapter_is_refused_naming_what_is_wrong(
    breaks, message, tmp_path, tiny_checkpoint_of, peft_adapter_of
):
    folder = _copy(peft_adapter_of("llama"), tmp_path / "bad")
    breaks(folder)
    cfg = load_model_config(tiny_checkpoint_of("llama"))
    with pytest.raises(ValueError, match=message):
        read_adapter(folder, cfg, 16, "float32")


def test_a_bfloat16_adapter_reads_as_its_float32_values_rounded(
    tiny_checkpoint_of, peft_adapter_of
):
    cfg = load_model_config(tiny_checkpoint_of("llama"))
    f32 = read_adapter(peft_adapter_of("llama", seed=5), cfg, 8, "float32")
    bf16 = read_adapter(peft_adapter_of("llama", seed=5, dtype="bfloat16"), cfg, 8, "float32")
    for layer32, layer16 in zip(f32, bf16, strict=True):
        for name, value in layer32.items():
            a_part = value.astype(ml_dtypes.bfloat16).astype(np.float32)
            if name.startswith("lora_a_"):  # B holds the scaling too: rounded, then scaled
                np.testing.assert_array_equal(layer16[name], a_part)
            else:
                np.testing.assert_allclose(layer16[name], value, rtol=1e-2, atol=1e-6)


def test_an_adapter_of_another_shape_is_refused(tiny_checkpoint_of, peft_adapter_of):
    """An adapter of one checkpoint against another's shapes (a narrower MLP): the tensor
    named, with both shapes."""
    adapter = peft_adapter_of("llama", targets=MLP, rank=2)
    other = load_model_config(tiny_checkpoint_of("llama", intermediate_size=96))
    with pytest.raises(
        ValueError, match=r"proj.lora_B.weight has shape \[128, 2\], the base model needs \[96, 2\]"
    ):
        read_adapter(adapter, other, 16, "float32")


def test_an_engine_with_a_bad_adapter_at_start_fails_to_start(tmp_path, tiny_checkpoint_of):
    with pytest.raises(ValueError, match="no such folder"):
        core_of(
            tiny_checkpoint_of("llama"), max_loras=1, lora_modules=(("x", str(tmp_path / "no")),)
        )
    with pytest.raises(ValueError, match="need max_loras"):
        CoreConfig(model_path=tmp_path, lora_modules=(("x", "y"),))
