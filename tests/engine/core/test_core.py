"""engine.core on the real tiny model: the scheduler and runner over paged KV give each
sequence the tokens greedy decoding gives it one whole prefill at a time (the slot
engine's prefill, checked against transformers in test_parity), whether it runs alone
or in a full batch, in chunks beside decode rows, after a prefix-cache hit, or after
being preempted; seeded sampling likewise."""

from __future__ import annotations

import numpy as np
import pytest

from engine.checkpoint import load_params
from engine.config import load_model_config
from engine.core.core import CoreConfig, EngineCore
from engine.core.scheduler import Emitted, Sequence
from engine.model import matmul_layout, prefill_forward
from engine.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0, seed=0)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(3, vocab, n).tolist() for n in (5, 37, 20, 3, 64)]


def greedy_reference(folder, prompt: list[int], count: int) -> list[int]:  # type: ignore[no-untyped-def]
    cfg = load_model_config(folder)
    params = matmul_layout(load_params(folder, cfg, "float32"))
    tokens = list(prompt)
    for _ in range(count):
        ids = np.asarray(tokens, np.int32)
        logits, _, _ = prefill_forward(params, ids, len(ids), cfg.rope_inv_freq(), cfg, True)
        tokens.append(int(np.argmax(np.asarray(logits)[-1])))
    return tokens[len(prompt) :]


def run(core: EngineCore, seqs: list[Sequence], limit: int = 500) -> dict[str, list[Emitted]]:
    out: dict[str, list[Emitted]] = {s.seq_id: [] for s in seqs}
    for seq in seqs:
        core.add(seq)
    for _ in range(limit):
        if not core.scheduler.busy:
            return out
        for event in core.step():
            out[event.seq_id].append(event)
    raise AssertionError("sequences did not finish")


def tokens_of(events: dict[str, list[Emitted]]) -> dict[str, list[int]]:
    return {k: [e.token for e in v] for k, v in events.items()}


def make(folder, **options) -> EngineCore:  # type: ignore[no-untyped-def]
    config = dict(
        model_path=folder, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32,
        chunk_size=16, page_size=8, num_pages=64,
    )  # fmt: skip
    return EngineCore(CoreConfig(**(config | options)))


def seqs_of(ps: list[list[int]], sampling: SamplingParams, max_tokens: int) -> list[Sequence]:
    return [Sequence(f"s{i}", tuple(p), sampling, max_tokens) for i, p in enumerate(ps)]


@pytest.fixture(scope="module")
def folder(tiny_checkpoint_of):  # type: ignore[no-untyped-def]
    return tiny_checkpoint_of("llama")


def test_greedy_matches_whole_prefill_decoding_in_a_full_batch(folder) -> None:  # type: ignore[no-untyped-def]
    core = make(folder)
    ps = prompts(core.model_config.vocab_size)
    got = tokens_of(run(core, seqs_of(ps, GREEDY, 6)))
    for i, p in enumerate(ps):
        assert got[f"s{i}"] == greedy_reference(folder, p, 6), i
    # every page is back (some kept as cached prefix blocks) and every row free
    stats = core.page_stats()
    assert stats.free == stats.total and not core.scheduler.running


def test_alone_batched_preempted_and_cached_give_the_same_tokens(folder) -> None:  # type: ignore[no-untyped-def]
    ps = prompts(load_model_config(folder).vocab_size)
    for sampling in (GREEDY, SEEDED):
        batched = tokens_of(run(make(folder), seqs_of(ps, sampling, 8)))
        for i, p in enumerate(ps):
            alone = tokens_of(run(make(folder), [Sequence(f"s{i}", tuple(p), sampling, 8)]))
            assert alone[f"s{i}"] == batched[f"s{i}"], (sampling, i)
        # 10 pages of 8 (one max_model_len sequence): some are preempted
        tight = make(folder, num_pages=10, max_model_len=80)
        seqs = seqs_of(ps, sampling, 8)
        assert tokens_of(run(tight, seqs)) == batched
        assert sum(s.preempted for s in seqs) > 0
        # the same prompts again: their leading pages are prefix-cache hits
        again = seqs_of(ps, sampling, 8)
        cached = make(folder)
        run(cached, seqs_of(ps, sampling, 8))
        assert tokens_of(run(cached, again)) == batched
        assert sum(s.cached_tokens for s in again) >= 64  # every prompt's whole pages


def test_stop_tokens_max_tokens_and_abort(folder) -> None:  # type: ignore[no-untyped-def]
    core = make(folder)
    p = prompts(core.model_config.vocab_size)[1]
    free = greedy_reference(folder, p, 5)
    stop = Sequence("stop", tuple(p), GREEDY, 50, stop_token_ids=frozenset({free[2]}))
    events = run(core, [stop])["stop"]
    assert [e.token for e in events] == free[:3] and events[-1].finish_reason == "stop"
    length = run(core, [Sequence("len", tuple(p), GREEDY, 4)])["len"]
    assert [e.finish_reason for e in length] == [None, None, None, "length"]
    core.add(Sequence("gone", tuple(p), GREEDY, 50))
    core.step()
    assert core.abort("gone") and not core.abort("gone")
    assert core.page_stats().free == core.page_stats().total
