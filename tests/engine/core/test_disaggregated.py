"""engine.core.disaggregated on the real tiny model over CPU devices: prompts computed on
one device set and decoded on another give every sample the tokens, logprob bits and
finish reasons one device set gives (greedy, seeded, penalties, prompt logprobs, stop
tokens, max_tokens 1, a grammar whose state crosses with the sequence, preemption on the
decode set, an abort), with the prompt's K/V copied across rather than computed again;
and the device sets are checked at start."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from engine.config import load_model_config
from engine.core.core import CoreConfig
from engine.core.disaggregated import DisaggregatedCore
from engine.core.messages import Abort, Grammar
from engine.core.sequence import SequenceState
from engine.types import SamplingParams
from tests.engine.core.test_core import Only
from tests.engine.core.test_loop import (
    GREEDY,
    SEEDED,
    Script,
    drive,
    make,
    prompts,
    request,
    workload,
)


@pytest.fixture(scope="module")
def folder(tiny_checkpoint_of):  # type: ignore[no-untyped-def]
    return tiny_checkpoint_of("llama")


def config(folder: Any, **options: Any) -> CoreConfig:
    """test_loop's `make` settings, one step in flight."""
    base: dict[str, Any] = dict(
        model_path=folder, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32,
        chunk_size=16, page_size=8, num_pages=64, async_scheduling=True,
    )  # fmt: skip
    return CoreConfig(**(base | options))


def split(folder: Any, **options: Any) -> DisaggregatedCore:
    """Prefill on the first device, decode on the next (device sets as counts)."""
    return DisaggregatedCore.build(config(folder, **options), "1", "1")


def with_repeats(script: Script, vocab: int) -> Script:
    """A sample whose penalties pull it back to the tokens it has (its row's counts must
    hold its first token, sampled on the other set)."""
    repeats = SamplingParams(
        temperature=0.0,
        seed=0,
        presence_penalty=-2.0,
        frequency_penalty=-2.0,
        repetition_penalty=1.25,  # its prompt's marks are rebuilt on the other set too
    )
    script[1] = [request("r", prompts(vocab)[0][19::-1], repeats, 8)]
    return script


def drained(core: DisaggregatedCore) -> None:
    """Every page back (held by no sequence), nothing running anywhere."""
    for part in (core.prefill, core.decode):
        stats = part.page_stats()
        assert stats.free == stats.total and not part.scheduler.running
        assert not part.scheduler.waiting


def test_a_prompt_computed_on_one_set_decodes_on_the_other_with_the_same_bits(folder) -> None:  # type: ignore[no-untyped-def]
    vocab = load_model_config(folder).vocab_size
    free, _ = drive(make(folder, False), workload(vocab, None))
    stop = free[("a", 0)][6][0]  # a stop token that ends "a" mid-run, others anywhere
    want, _ = drive(make(folder, False), with_repeats(workload(vocab, stop), vocab))
    core = split(folder)
    got, loop = drive(core, with_repeats(workload(vocab, stop), vocab))
    assert len(set(t for t, _, _ in want[("r", 0)])) < 8  # its first token's count crossed
    assert got == want  # tokens, logprob bits and finish reasons, every sample
    # every sample its first token did not end went across with its pages, but for the
    # prompt blocks a sample before it had brought ("b"'s second sample)
    moved = [k for k, v in want.items() if v[0][2] is None]
    ps = dict(zip("abcdefgh", prompts(vocab), strict=True)) | {"r": prompts(vocab)[0][19::-1]}
    shared = (len(ps["b"]) - 1) // 8 if {("b", 0), ("b", 1)} <= set(moved) else 0
    assert core.transfers.sequences == len(moved) > 0
    assert core.transfers.pages == sum(-(-len(ps[r]) // 8) for r, _ in moved) - shared > 0
    assert loop.counters.ahead > 0
    assert core.transfers.waits > 0  # 9 samples, 4 decode rows: some waited for a row
    drained(core)
    assert not core.busy


def test_a_grammar_preemption_and_an_abort_across_the_sets(folder) -> None:  # type: ignore[no-untyped-def]
    vocab = load_model_config(folder).vocab_size
    ps = [p[:30] for p in prompts(vocab)]
    only = Only([11, 12, 13], 6, vocab)
    script: Script = {
        0: [request(k, ps[i], SEEDED, 24) for i, k in enumerate("abc")],
        1: [request("g", ps[3], GREEDY, 30, grammar=Grammar("regex", "x"))],  # fits 64
        4: [request("d", ps[4], GREEDY, 24)],
        6: [Abort((("b", 0),))],
    }
    small = {"num_pages": 16, "max_model_len": 64}  # the decode set must preempt
    want, _ = drive(make(folder, False, **small), dict(script), lambda kind, text: only)
    core = split(folder, **small)
    got, _ = drive(core, dict(script), lambda kind, text: only)
    assert core.decode.scheduler.preemptions > 0
    assert {k: v for k, v in got.items() if k[0] != "b"} == {
        k: v for k, v in want.items() if k[0] != "b"
    }
    grammar = [t for t, _, _ in got[("g", 0)]]
    assert len(grammar) == 6 and set(grammar) <= {11, 12, 13}  # its matcher crossed over
    assert got[("b", 0)] == want[("b", 0)][: len(got[("b", 0)])]
    drained(core)


def test_blocks_the_decode_set_has_are_not_copied_again(folder) -> None:  # type: ignore[no-untyped-def]
    vocab = load_model_config(folder).vocab_size
    prompt = prompts(vocab)[2][:45]  # 5 whole pages of 8 and 5 positions
    core = split(folder)
    first, _ = drive(core, {0: [request("a", prompt, GREEDY, 4)], 1: []})
    assert core.transfers.pages == 6
    again, _ = drive(core, {0: [request("b", prompt, GREEDY, 4)], 1: []})
    # its 5 whole blocks were cached on the decode set: only its last page came across
    assert core.transfers.pages == 7 and core.transfers.sequences == 2
    assert again[("b", 0)] == first[("a", 0)] and len(first[("a", 0)]) == 4
    # without a prefix cache every page comes across, every time, to the same tokens
    plain = split(folder, prefix_caching=False)
    for rid in "ab":
        got, _ = drive(plain, {0: [request(rid, prompt, GREEDY, 4)], 1: []})
        assert got[(rid, 0)] == first[("a", 0)]
    assert plain.transfers.pages == 12
    drained(plain)


def test_an_abort_while_waiting_for_a_decode_row(folder) -> None:  # type: ignore[no-untyped-def]
    """A sequence between the sets (first token sampled, no decode row free yet) is
    aborted there: its prefill pages go back, the others run on."""
    vocab = load_model_config(folder).vocab_size
    core = split(folder)
    for i, prompt in enumerate(prompts(vocab)):
        core.add(SequenceState(f"s{i}", tuple(prompt), GREEDY, 30))
    emitted: dict[str, list[int]] = {}
    while not core.handing_over:
        pending = core.launch()
        assert pending is not None
        for e in core.finish(pending):
            emitted.setdefault(e.seq_id, []).append(e.token)
    waiting = core.handing_over[-1]
    assert emitted[waiting] and core.abort(waiting) and waiting not in core.handing_over
    assert not core.abort(waiting)  # gone everywhere
    while core.busy:
        pending = core.launch()
        if pending is not None:
            for e in core.finish(pending):
                emitted.setdefault(e.seq_id, []).append(e.token)
    assert len(emitted[waiting]) == 1  # its first token, nothing after the abort
    assert all(len(t) == 30 for s, t in emitted.items() if s != waiting)
    drained(core)


def test_tensor_parallel_sets(folder) -> None:  # type: ignore[no-untyped-def]
    """Two devices each: the copy crosses meshes split by kv head."""
    vocab = load_model_config(folder).vocab_size
    ps = prompts(vocab)
    script: Script = {
        0: [request("a", ps[0], GREEDY, 12), request("b", ps[1], SEEDED, 9, n=2)],
        1: [request("c", ps[2], GREEDY, 12)],
    }
    want, _ = drive(make(folder, False, devices=(0, 1), tensor_parallel_size=2), dict(script))
    core = DisaggregatedCore.build(replace(config(folder), tensor_parallel_size=2), "0-1", "2,3")
    got, _ = drive(core, dict(script))
    assert got == want and len(got[("b", 1)]) == 9 and core.transfers.pages > 0
    drained(core)


@pytest.mark.parametrize(
    ("prefill", "generate", "options", "problem"),
    [
        ("0-1", "1,2", {}, "share devices"),
        ("1", "9-9", {}, "must be one of the devices"),
        ("3", "2", {}, "only 1 of 4 devices are left"),
        ("0-1", "2-3", {"tensor_parallel_size": 4}, "must be 1 or the set's"),
        ("1", "1", {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}'},
         "speculative decoding is not supported"),
    ],
)  # fmt: skip
def test_device_sets_are_checked_at_start(
    folder: Any, prefill: str, generate: str, options: dict[str, Any], problem: str
) -> None:
    base = CoreConfig(model_path=folder, max_model_len=128, num_pages=64, page_size=8)
    with pytest.raises(ValueError, match=problem):
        DisaggregatedCore.build(replace(base, **options), prefill, generate)
