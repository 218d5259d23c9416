"""LoRA adapters in the engine core: rows of different adapters (and the base model) in
one batch each get the bits they get alone; an adapter that is not resident waits for an
idle pool slot (least recently used first) and never takes one in use; the prefix cache
never hands one adapter's blocks to another."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.core.core import EngineCore
from engine.core.lora_slots import LoraSlots
from engine.core.scheduler import Emitted, SequenceState
from engine.lora import NO_ADAPTER
from engine.types import SamplingParams
from tests.engine.conftest import core_of, run_core
from tests.engine.core.test_recompile import compile_events  # noqa: F401

pytest.importorskip("peft")

GREEDY = SamplingParams(temperature=0.0, seed=0, logprobs=3)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=77, logprobs=3)
ADAPTERS = {  # name -> write_peft_adapter's options: ranks, targets and scalings differ
    "a": {"rank": 4, "seed": 1},
    "b": {"rank": 8, "seed": 2, "targets": ("gate_proj", "up_proj", "down_proj")},
    "c": {"rank": 2, "seed": 3, "targets": ("q_proj", "v_proj", "o_proj", "down_proj")},
    "d": {"rank": 6, "seed": 4, "rslora": True, "alpha": 3.0},
}


@pytest.fixture(scope="module")
def adapters(peft_adapter_of) -> dict[str, Path]:
    return {name: peft_adapter_of("llama", **options) for name, options in ADAPTERS.items()}


def lora_core(base: Path, adapters: dict[str, Path], **options: object) -> EngineCore:
    modules = tuple((name, str(path)) for name, path in adapters.items())
    config = dict(max_loras=4, max_lora_rank=8, lora_modules=modules, max_num_seqs=8)
    return core_of(base, **(config | options))  # type: ignore[no-any-return]


def seq(core: EngineCore, name: str, adapter: str | None, prompt: list[int], **kw) -> SequenceState:  # type: ignore[no-untyped-def]
    assert core.adapters is not None
    out = SequenceState(
        name, tuple(prompt), kw.pop("sampling", GREEDY), kw.pop("max_tokens", 8), **kw
    )
    out.adapter = 0 if adapter is None else core.adapters.by_name[adapter]
    return out


def bits(events: list[Emitted]) -> list[tuple[int, float, tuple[tuple[int, float], ...]]]:
    return [(e.token, e.logprob, e.top) for e in events]


def test_four_adapters_and_the_base_in_one_batch_give_each_row_its_bits_alone(
    tiny_checkpoint_of, adapters
):
    core = lora_core(tiny_checkpoint_of("llama"), adapters)
    rng = np.random.default_rng(3)
    rows = [(f"{n}-{i}", n, rng.integers(3, 500, 5 + 11 * i).tolist()) for i, n in
            enumerate(["a", "b", None, "c", "d"])]  # fmt: skip
    rows += [("a-seeded", "a", rows[4][2]), ("base-seeded", None, rows[4][2])]
    alone = {}
    for name, adapter, prompt in rows:
        sampling = SEEDED if "seeded" in name else GREEDY
        s = seq(core, name, adapter, prompt, sampling=sampling, max_tokens=10)
        alone[name] = bits(run_core(core, [s])[name])
    mixed = [
        seq(core, name, adapter, prompt, sampling=SEEDED if "seeded" in name else GREEDY,
            max_tokens=10)
        for name, adapter, prompt in rows
    ]  # fmt: skip
    together = run_core(core, mixed)
    assert {name: bits(events) for name, events in together.items()} == alone
    # the adapter changes the row: the same prompt and seed under the base model differ
    assert alone["a-seeded"] != alone["base-seeded"]


def test_a_rows_bits_do_not_depend_on_which_slot_holds_its_adapter(tiny_checkpoint_of, adapters):
    base = tiny_checkpoint_of("llama")
    prompt = list(range(40, 70))
    first = lora_core(base, adapters)  # "d" loaded into slot 0 alone
    s = seq(first, "s", "d", prompt)
    alone = bits(run_core(first, [s])["s"])
    assert first.scheduler.lora.slot(s.adapter) == 0
    second = lora_core(base, adapters)  # "d" in slot 3, the others resident before it
    for i, name in enumerate("abc"):
        run_core(second, [seq(second, f"w{i}", name, [5, 6, 7], max_tokens=1)])
    s = seq(second, "s", "d", prompt)
    assert bits(run_core(second, [s])["s"]) == alone
    assert second.scheduler.lora.slot(s.adapter) == 3


def test_an_adapter_not_resident_waits_for_a_slot_and_never_takes_one_in_use(
    tiny_checkpoint_of, adapters
):
    """Two slots, four adapters, eight sequences at once: at every step the running
    sequences use at most two adapters, each running sequence's adapter stays in its
    slot while it runs, and every sequence gets its tokens alone."""
    core = lora_core(tiny_checkpoint_of("llama"), adapters, max_loras=2)
    names = ["a", "b", "c", "d", "a", "b", "c", "d"]
    alone = {}
    for i, name in enumerate(names[:4]):
        s = seq(core, f"{name}{i}", name, [9, 8, 7, 6 + i], max_tokens=6)
        alone[name] = [e.token for e in run_core(core, [s])[s.seq_id]]
    seqs = [seq(core, f"{n}{i}", n, [9, 8, 7, 6 + "abcd".index(n)], max_tokens=6)
            for i, n in enumerate(names)]  # fmt: skip
    for s in seqs:
        core.add(s)
    out: dict[str, list[int]] = {s.seq_id: [] for s in seqs}
    slots = core.scheduler.lora
    held: dict[str, int] = {}
    waited = False
    while core.scheduler.busy:
        running = core.scheduler.running
        assert len({s.adapter for s in running}) <= 2
        for s in running:
            assert held.setdefault(s.seq_id, slots.slot(s.adapter)) == slots.slot(s.adapter)
        waited |= any(w.adapter not in {s.adapter for s in running} for w in core.scheduler.waiting)
        for event in core.step():
            out[event.seq_id].append(event.token)
    assert waited
    assert out == {s.seq_id: alone[s.seq_id[0]] for s in seqs}


def test_stats_name_the_adapters_running_and_waiting(tiny_checkpoint_of, adapters):
    """vLLM's lora_requests_info, as the core reports it (server.metrics serves it)."""
    core = lora_core(tiny_checkpoint_of("llama"), adapters, max_loras=2)
    for i, name in enumerate("abcd"):
        core.add(seq(core, f"s{i}", name, [9, 8, 7], max_tokens=3))
    core.add(seq(core, "base", None, [9, 8, 7], max_tokens=3))
    core.step()
    stats = core.stats(1)
    assert (stats.lora_running, stats.lora_waiting, stats.max_loras) == (("a", "b"), ("c", "d"), 2)
    assert stats.running == 3 and stats.waiting == 2


def test_the_least_recently_used_idle_slot_is_taken():
    slots = LoraSlots(2)
    assert slots.acquire(0) == NO_ADAPTER and slots.available(0)
    assert (slots.acquire(1), slots.acquire(2)) == (0, 1)
    assert slots.take_writes() == ((0, 1), (1, 2))
    assert not slots.available(3) and slots.available(1)
    slots.release(2)
    slots.release(1)  # idle now: 2's slot (used longer ago), then 1's
    assert slots.acquire(3) == 1 and slots.take_writes() == ((1, 3),)
    assert slots.acquire(1) == 0 and slots.take_writes() == ()  # still resident
    assert slots.running() == [1, 3]


def test_the_prefix_cache_never_crosses_adapters(tiny_checkpoint_of, adapters):
    core = lora_core(tiny_checkpoint_of("llama"), adapters)
    prompt = list(range(100, 140))

    def cached(name: str, adapter: str | None) -> tuple[int, list[int]]:
        events = run_core(core, [seq(core, name, adapter, prompt, max_tokens=3)])[name]
        return events[0].cached_tokens, [e.token for e in events]

    first_a = cached("a1", "a")
    assert first_a[0] == 0
    assert cached("b1", "b")[0] == 0  # the same prompt under another adapter
    assert cached("base1", None)[0] == 0
    again = cached("a2", "a")
    assert again[0] > 0 and again[1] == first_a[1]
    assert cached("base2", None)[0] > 0


def test_adapters_loaded_and_swapped_after_warmup_compile_nothing(
    tiny_checkpoint_of,
    adapters,
    compile_events,  # noqa: F811
):
    """Two slots for three adapters (slots rewritten while serving), an adapter loaded at
    run time, speculation's draft rows: no program is traced or compiled after warm-up."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    some = {k: adapters[k] for k in "ab"}
    core = lora_core(tiny_checkpoint_of("llama"), some, max_loras=2, speculative_config=spec)
    core.warmup()
    compile_events.clear()
    assert core.adapters is not None
    core.adapters.load("c", adapters["c"])
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    for round_ in range(2):
        seqs = [seq(core, f"{n}{round_}", n, prompt, max_tokens=6) for n in ("a", "b", "c", None)]
        run_core(core, seqs)
    assert compile_events == []


def test_a_sequence_naming_an_adapter_on_a_core_without_lora_is_refused(tiny_checkpoint_of):
    core = core_of(tiny_checkpoint_of("llama"))
    bad = SequenceState("s", (1, 2, 3), GREEDY, 2)
    bad.adapter = 1
    with pytest.raises(ValueError, match="not enabled"):
        core.add(bad)
