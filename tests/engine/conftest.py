"""Fixtures of the engine tests: tiny checkpoints per architecture, and small engine cores."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

CheckpointFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_checkpoint_of(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """arch, **options -> a tiny checkpoint folder, written once per distinct arguments."""
    from engine.tiny import write_tiny_checkpoint

    made: dict[tuple[Any, ...], Path] = {}

    def make(arch: str = "llama", **options: Any) -> Path:
        key = (arch, *sorted(options.items()))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}")
            made[key] = write_tiny_checkpoint(folder, arch=arch, **options)
        return made[key]

    return make


def core_of(folder: Path, **options: Any) -> Any:
    """A small EngineCore: 4 sequences, context 128, steps of 32 tokens, chunks of 16,
    pages of 8 (options override any of them)."""
    from engine.core.core import CoreConfig, EngineCore

    config = dict(
        model_path=folder, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32,
        chunk_size=16, page_size=8,
    )  # fmt: skip
    return EngineCore(CoreConfig(**(config | options)))


def run_core(core: Any, seqs: Iterable[Any], limit: int = 5000) -> dict[str, list[Any]]:
    """Add the sequences and step until every one has ended: each one's Emitted events."""
    seqs = list(seqs)
    out: dict[str, list[Any]] = {s.seq_id: [] for s in seqs}
    for seq in seqs:
        core.add(seq)
    for _ in range(limit):
        if not core.scheduler.busy:
            return out
        for event in core.step():
            out[event.seq_id].append(event)
    raise AssertionError("sequences did not finish")


def write_peft_adapter(
    base: Path,
    folder: Path,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    rslora: bool = False,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """A PEFT LoRA adapter of the checkpoint at `base`, written by PEFT's save_pretrained
    (adapter_config.json + adapter_model.safetensors): every A and B random, B nonzero
    (PEFT's own init leaves B zero: an adapter that changes nothing)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=rslora,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    lora = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, value in lora.named_parameters():
            if "lora_B" in name:
                value.copy_(torch.randn_like(value) * 0.1)
    lora.to(getattr(torch, dtype)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def peft_adapter_of(
    tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint_of: CheckpointFactory
) -> Callable[..., Path]:
    """arch, **write_peft_adapter's options -> an adapter folder, written once each."""
    made: dict[tuple[Any, ...], Path] = {}

    def make(arch: str = "llama", **options: Any) -> Path:
        key = (arch, *sorted(options.items()))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"lora-{arch}")
            made[key] = write_peft_adapter(tiny_checkpoint_of(arch), folder, **options)
        return made[key]

    return make
