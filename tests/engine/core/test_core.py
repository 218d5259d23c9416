"""engine.core on the real tiny model: the scheduler and runner over paged KV give each
sequence the tokens greedy decoding gives it one whole prefill at a time (the slot
engine's prefill, checked against transformers in test_parity), whether it runs alone
or in a full batch, in chunks beside decode rows, after a prefix-cache hit, or after
being preempted; seeded sampling likewise."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import numpy as np
import pytest

from engine import row_dot
from engine.config import load_model_config
from engine.core.core import CoreConfig, EngineCore, backend_shapes
from engine.core.scheduler import Emitted, SequenceState
from engine.core.shapes import SINGLE_ROW_BUCKET
from engine.types import SamplingParams
from tests.engine.conftest import run_core

GREEDY = SamplingParams(temperature=0.0, seed=0)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(3, vocab, n).tolist() for n in (5, 37, 20, 3, 64)]


def hf_model(folder):  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return torch, model.eval()


def hf_logprobs(folder, tokens: list[int]) -> np.ndarray:  # type: ignore[no-untyped-def]
    """transformers' log-softmax over `tokens` (float64), the reference of every check."""
    torch, model = hf_model(folder)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def greedy_reference(folder, prompt: list[int], count: int) -> list[int]:  # type: ignore[no-untyped-def]
    """transformers' forward pass, argmax, append: `count` greedy tokens (EOS is a token)."""
    torch, model = hf_model(folder)
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def run(core: EngineCore, seqs: list[SequenceState]) -> dict[str, list[Emitted]]:
    return run_core(core, seqs, limit=500)


def tokens_of(events: dict[str, list[Emitted]]) -> dict[str, list[int]]:
    return {k: [e.token for e in v] for k, v in events.items()}


def make(folder, **options) -> EngineCore:  # type: ignore[no-untyped-def]
    config = dict(
        model_path=folder, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32,
        chunk_size=16, page_size=8, num_pages=64,
    )  # fmt: skip
    return EngineCore(CoreConfig(**(config | options)))


def test_a_sequence_alone_runs_a_one_row_program_where_the_products_allow(folder) -> None:  # type: ignore[no-untyped-def]
    """On CPU a float32 model's products are engine.row_dot's, which keep a row's bits at
    one row, so a sequence decoding alone pads to no other rows (the next test holds its
    tokens to a batch's); bfloat16's too where the processor has AVX512-BF16. XLA's
    bfloat16 products do not, and pad to the smallest buckets."""
    assert make(folder).runner.shapes.bucket(1, 1) == SINGLE_ROW_BUCKET
    single = make(folder, dtype="bfloat16").runner.shapes.bucket(1, 1) == SINGLE_ROW_BUCKET
    assert single == row_dot.bf16_native()


def seqs_of(ps: list[list[int]], sampling: SamplingParams, max_tokens: int) -> list[SequenceState]:
    return [SequenceState(f"s{i}", tuple(p), sampling, max_tokens) for i, p in enumerate(ps)]


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
        solo = make(folder)  # one sequence at a time (the prompts share no page)
        for i, p in enumerate(ps):
            alone = tokens_of(run(solo, [SequenceState(f"s{i}", tuple(p), sampling, 8)]))
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


def logprob_events(
    core: EngineCore, ps: list[list[int]], ids: Iterable[int], sampling: SamplingParams
) -> dict[str, list[tuple[int, float]]]:
    """Prompts `ids` of `ps` run together: each one's (token, logprob) pairs."""
    seqs = [SequenceState(f"s{i}", tuple(ps[i]), sampling, 6) for i in ids]
    return {k: [(e.token, e.logprob) for e in v] for k, v in run(core, seqs).items()}


def test_logprob_bits_alone_and_among_31_others_at_a_served_width(tiny_checkpoint_of) -> None:  # type: ignore[no-untyped-def]
    """Hidden 256, 32 rows a step: where XLA:CPU's own reductions (jnp.mean in the norms,
    jax.nn.softmax in a draw) give a row other bits among 16 or more rows."""
    wide = tiny_checkpoint_of("llama", hidden_size=256, intermediate_size=512)
    vocab = load_model_config(wide).vocab_size
    rng = np.random.default_rng(4)
    ps = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(5, 30, 32)]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11, logprobs=2)
    for sampling in (replace(GREEDY, logprobs=2), seeded):
        core = make(wide, max_num_seqs=32, max_num_batched_tokens=256, num_pages=256)
        batched = logprob_events(core, ps, range(32), sampling)
        for i in (0, 13, 31):
            alone = logprob_events(core, ps, [i], sampling)
            assert alone[f"s{i}"] == batched[f"s{i}"], (sampling, i)


@pytest.mark.parametrize(
    ("kv_cache_dtype", "cached"), [("auto", [40, 32, 40, 16]), ("int8", [32, 32, 40, 16])]
)
def test_a_prefix_hit_gives_the_logprob_bits_of_none(folder, kv_cache_dtype, cached) -> None:  # type: ignore[no-untyped-def]
    """A hit skips whole pages (8 positions; chunks of 16) and the positions after it get
    the bits they get without it: also a prompt of 41 (5 whole pages and one position,
    which without the hit runs in a chunk [32, 41)) and one of 33 (whose last chunk
    [32, 33) is one position either way). Float32 pages: every query in the CPU kernel,
    whose bits do not depend on the form, so the 41's hit takes all 5 pages and its last
    position runs as a decode row; 8-bit pages: XLA's tiles and decode groups differ in
    the last bits, so the hit stops a page short and the position stays in a chunk."""
    rng = np.random.default_rng(9)
    vocab = load_model_config(folder).vocab_size
    ps = [rng.integers(3, vocab, n).tolist() for n in (41, 33, 44, 17)]
    for sampling in (replace(GREEDY, logprobs=1), replace(SEEDED, logprobs=2)):
        fresh = logprob_events(make(folder, kv_cache_dtype=kv_cache_dtype), ps, range(4), sampling)
        core = make(folder, kv_cache_dtype=kv_cache_dtype)
        logprob_events(core, ps, range(4), sampling)  # their blocks are cached now
        seqs = [SequenceState(f"s{i}", tuple(p), sampling, 6) for i, p in enumerate(ps)]
        again = {k: [(e.token, e.logprob) for e in v] for k, v in run(core, seqs).items()}
        assert again == fresh, sampling
        assert [s.cached_tokens for s in seqs] == cached


def test_a_preempted_sequence_gets_the_logprob_bits_it_had(tiny_checkpoint_of) -> None:  # type: ignore[no-untyped-def]
    """Recomputed after a preemption, a sequence's prompt runs in the chunks it ran in,
    and the tokens it had one a step, as decode rows, as they ran when sampled: its
    later tokens and logprobs keep their bits (hidden 256, where the chunk form of those
    positions gave other last bits)."""
    wide = tiny_checkpoint_of("llama", hidden_size=256, intermediate_size=512)
    rng = np.random.default_rng(3)
    vocab = load_model_config(wide).vocab_size
    ps = [rng.integers(3, vocab, int(n)).tolist() for n in rng.integers(5, 40, 8)]
    for sampling in (replace(GREEDY, logprobs=1), replace(SEEDED, seed=7, logprobs=1)):
        roomy = {k: [(e.token, e.logprob) for e in v] for k, v in run(
            make(wide, max_model_len=96, num_pages=128), seqs_of(ps, sampling, 40)
        ).items()}  # fmt: skip
        seqs = seqs_of(ps, sampling, 40)
        tight = run(make(wide, max_model_len=96, num_pages=12), seqs)
        assert sum(s.preempted for s in seqs) > 0
        assert {k: [(e.token, e.logprob) for e in v] for k, v in tight.items()} == roomy


def test_stop_tokens_max_tokens_and_abort(folder) -> None:  # type: ignore[no-untyped-def]
    core = make(folder)
    p = prompts(core.model_config.vocab_size)[1]
    free = greedy_reference(folder, p, 5)
    stop = SequenceState("stop", tuple(p), GREEDY, 50, stop_token_ids=frozenset({free[2]}))
    events = run(core, [stop])["stop"]
    assert [e.token for e in events] == free[:3] and events[-1].finish_reason == "stop"
    length = run(core, [SequenceState("len", tuple(p), GREEDY, 4)])["len"]
    assert [e.finish_reason for e in length] == [None, None, None, "length"]
    core.add(SequenceState("gone", tuple(p), GREEDY, 50))
    core.step()
    assert core.abort("gone") and not core.abort("gone")
    assert core.page_stats().free == core.page_stats().total


def test_prompt_logprobs_in_chunks_beside_decode_rows(folder) -> None:  # type: ignore[no-untyped-def]
    core = make(folder)
    ps = prompts(core.model_config.vocab_size)
    long = ps[4]  # 64 tokens: four chunks of 16
    seqs = seqs_of(ps[:2], GREEDY, 12) + [
        SequenceState("lp", tuple(long), GREEDY, 2, prompt_logprobs=3)
    ]
    events = run(core, seqs)["lp"]
    entries = events[0].prompt_logprobs
    assert entries is not None and events[1].prompt_logprobs is None
    assert len(entries) == len(long) and entries[0] is None
    want = hf_logprobs(folder, long)
    for p, entry in enumerate(entries[1:], start=1):
        assert entry is not None and entry.token_id == long[p]
        np.testing.assert_allclose(entry.logprob, want[p - 1, long[p]], rtol=1e-4, atol=1e-4)
        best = np.argsort(-want[p - 1])[:3]
        assert [t for t, _ in entry.top] == best.tolist(), p
    # a prompt-logprobs sequence takes nothing from the prefix cache: every position is run
    again = SequenceState("again", tuple(long), GREEDY, 2, prompt_logprobs=0)
    (first, *_) = run(core, [again])["again"]
    assert again.cached_tokens == 0 and first.prompt_logprobs is not None
    assert [e.token_id for e in first.prompt_logprobs[1:]] == long[1:]  # type: ignore[union-attr]


class Only:
    """A constraint that allows `allowed` tokens and is complete after `length` of them."""

    def __init__(self, allowed: list[int], length: int, vocab: int) -> None:
        from engine.token_mask import token_bitmask

        self.mask = token_bitmask(allowed, vocab)
        self.length = length
        self.spec = ("regex", "test")

    def initial_mask(self) -> np.ndarray:
        return self.mask

    def matcher(self) -> OnlyMatcher:
        return OnlyMatcher(self)


class OnlyMatcher:
    def __init__(self, constraint: Only) -> None:
        self.constraint = constraint
        self.taken = 0

    def advance(self, token_id: int) -> bool:
        bits = np.unpackbits(self.constraint.mask.view(np.uint8), bitorder="little")
        if not bits[token_id]:
            raise ValueError(f"token {token_id} is not allowed")
        self.taken += 1
        return self.taken >= self.constraint.length

    def fill_mask(self, out: np.ndarray) -> None:
        out[:] = self.constraint.mask

    def rollback(self, count: int) -> None:
        self.taken -= count


def test_a_grammar_masks_every_token_and_ends_the_sample(folder) -> None:  # type: ignore[no-untyped-def]
    core = make(folder)
    vocab = core.model_config.vocab_size
    ps = prompts(vocab)
    constrained = replace(SEEDED, constraint=Only([11, 12, 13], 5, vocab))
    seqs = seqs_of(ps[:3], GREEDY, 8) + [SequenceState("g", tuple(ps[3]), constrained, 50)]
    events = run(core, seqs)
    tokens = [e.token for e in events["g"]]
    assert len(tokens) == 5 and set(tokens) <= {11, 12, 13}
    assert events["g"][-1].done and events["g"][-1].finish_reason == "stop"
    # the unconstrained neighbours are as they are alone
    assert tokens_of(events)["s0"] == tokens_of(run(make(folder), seqs_of(ps[:1], GREEDY, 8)))["s0"]


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_gives_the_tokens_of_one_device(folder, tp: int) -> None:  # type: ignore[no-untyped-def]
    ps = prompts(load_model_config(folder).vocab_size)
    for sampling in (GREEDY, SEEDED):
        one = tokens_of(run(make(folder), seqs_of(ps, sampling, 6)))
        split = make(folder, tensor_parallel_size=tp)
        assert split.runner.pages.sharding.spec[2] == "model"  # kv heads over the mesh
        assert tokens_of(run(split, seqs_of(ps, sampling, 6))) == one, (sampling, tp)


def test_a_step_takes_at_most_max_prefill_seqs_prompt_chunks(folder) -> None:  # type: ignore[no-untyped-def]
    core = make(folder, max_prefill_seqs=2, max_num_batched_tokens=64)
    ps = prompts(core.model_config.vocab_size)
    for seq in seqs_of(ps, GREEDY, 3):
        core.add(seq)
    widest = 0
    while core.scheduler.busy:
        plan = core.scheduler.schedule()
        assert plan is not None
        chunks = [r for r in plan.rows if len(r.chunk.tokens) > 1 or not r.emits]
        widest = max(widest, len(chunks))
        core.scheduler.update(plan, core.runner.step(plan))
    assert widest == 2


def test_a_prompt_chunk_runs_beside_every_decode_row(folder) -> None:  # type: ignore[no-untyped-def]
    """A budget one chunk wide would hold a long prompt back until the decodes end: the core
    shrinks its chunk to leave room for max_num_seqs decode rows."""
    core = make(folder, max_num_batched_tokens=16, chunk_size=16)
    assert core.chunk_size == 8  # 16 less 4 decode rows, in whole pages of 8
    vocab = core.model_config.vocab_size
    ps = prompts(vocab)
    for seq in seqs_of(ps[:3], GREEDY, 40):
        core.add(seq)
    while any(len(s.output) == 0 for s in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    core.add(SequenceState("long", tuple(range(3, 60)), GREEDY, 2))
    plan = core.scheduler.schedule()
    assert plan is not None
    decodes = [r for r in plan.rows if len(r.chunk.tokens) == 1 and r.emits]
    assert len(decodes) == 3 and len(plan.rows) == 4  # the long prompt's chunk among them
    core.scheduler.update(plan, core.runner.step(plan))


def test_beside_decode_rows_a_prompt_goes_in_smaller_chunks_with_the_same_tokens(folder) -> None:  # type: ignore[no-untyped-def]
    """Where the attention backend gives a query the same bits in any chunk (CPU's
    kernel), a step with decode rows takes prompt chunks of decode_chunk_size: a prompt
    that arrives while others decode goes in chunks of 8, prompts with nothing decoding
    in chunks of 16, and every sequence gets the tokens it gets alone (greedy, then
    seeded with the first pass's prompts as prefix-cache hits)."""
    core = make(folder, decode_chunk_size=8)
    assert core.scheduler.config.any_form_hits and core.decode_chunk_size == 8
    ps = prompts(core.model_config.vocab_size)
    long = tuple(range(3, 60))
    chunks: list[tuple[bool, int]] = []  # (decode rows in the step, a prompt chunk's size)

    def step(events: dict[str, list[Emitted]]) -> None:
        plan = core.scheduler.schedule()
        assert plan is not None
        decoding = any(len(r.chunk.tokens) == 1 and r.generated for r in plan.rows)
        chunks.extend((decoding, len(r.chunk.tokens)) for r in plan.rows if not r.generated)
        for event in core.scheduler.update(plan, core.runner.step(plan)):
            events[event.seq_id].append(event)

    for sampling in (GREEDY, SEEDED):
        events: dict[str, list[Emitted]] = {f"s{i}": [] for i in range(3)} | {"long": []}
        for seq in seqs_of(ps[:3], sampling, 12):
            core.add(seq)
        while any(len(s.output) == 0 for s in core.scheduler.running) or core.scheduler.waiting:
            step(events)
        core.add(SequenceState("long", long, sampling, 6))
        while core.scheduler.busy:
            step(events)
        solo = make(folder)
        for i, p in enumerate([*ps[:3], list(long)]):
            name, n = (f"s{i}", 12) if i < 3 else ("long", 6)
            want = tokens_of(run(solo, [SequenceState(name, tuple(p), sampling, n)]))
            assert [e.token for e in events[name]] == want[name], (sampling, name)
    assert (False, 16) in chunks  # the 37-token prompt's first chunk, nothing decoding
    assert (True, 8) in chunks and all(n <= 8 for decoding, n in chunks if decoding)


def test_penalties_read_their_own_sequences_counts(folder) -> None:  # type: ignore[no-untyped-def]
    """A penalized sequence gets the same tokens alone (device row 0) and admitted after
    three others (another row, beside rows with counts of their own)."""
    ps = prompts(load_model_config(folder).vocab_size)
    penalized = SamplingParams(temperature=0.0, seed=0, frequency_penalty=2.0, presence_penalty=1.0)

    def tokens(seqs: list[SequenceState]) -> list[int]:
        return tokens_of(run(make(folder), seqs))["p"]

    alone = tokens([SequenceState("p", tuple(ps[1]), penalized, 12)])
    assert alone != tokens([SequenceState("p", tuple(ps[1]), GREEDY, 12)])  # the penalty matters
    others = seqs_of(ps[2:5], GREEDY, 12)
    assert tokens([*others, SequenceState("p", tuple(ps[1]), penalized, 12)]) == alone


def test_repetition_penalty_is_transformers_alone_batched_and_preempted(folder) -> None:  # type: ignore[no-untyped-def]
    """Greedy with repetition_penalty 1.5 gives transformers' RepetitionPenaltyLogitsProcessor
    tokens (over the prompt and the output so far), in a full batch beside greedy rows, and
    when preemption makes its row's counts (prompt marks too) be built again."""
    torch, model = hf_model(folder)
    processor = pytest.importorskip("transformers").RepetitionPenaltyLogitsProcessor(1.5)
    ps = prompts(load_model_config(folder).vocab_size)
    repeated = SamplingParams(temperature=0.0, seed=0, repetition_penalty=1.5)

    def reference(prompt: list[int]) -> list[int]:
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(8):
                ids = torch.tensor([tokens])
                scores = processor(ids, model(ids).logits[:, -1].float())
                tokens.append(int(scores[0].argmax()))
        return tokens[len(prompt) :]

    want = {f"s{i}": reference(p) for i, p in enumerate(ps)}
    assert want != tokens_of(run(make(folder), seqs_of(ps, GREEDY, 8)))  # the penalty matters
    mixed = seqs_of(ps, repeated, 8)[:3] + seqs_of(ps, GREEDY, 8)[3:]
    got = tokens_of(run(make(folder), mixed))
    assert {k: got[k] for k in ("s0", "s1", "s2")} == {k: want[k] for k in ("s0", "s1", "s2")}
    tight = make(folder, num_pages=10, max_model_len=80)  # as above: some are preempted
    seqs = seqs_of(ps, repeated, 8)
    assert tokens_of(run(tight, seqs)) == want
    assert sum(s.preempted for s in seqs) > 0


def test_a_row_taken_over_samples_with_its_new_sequences_parameters(folder) -> None:  # type: ignore[no-untyped-def]
    """One device row: a greedy sequence, then at once a penalized one in the same row (the
    runner reuses the rows' stacked sampling arrays only while every row holds the same
    ones): the penalized one gets the tokens it gets in a core of its own."""
    ps = prompts(load_model_config(folder).vocab_size)
    penalized = SamplingParams(temperature=0.0, seed=0, frequency_penalty=2.0, presence_penalty=1.0)
    alone = tokens_of(run(make(folder), [SequenceState("p", tuple(ps[1]), penalized, 12)]))["p"]
    assert (
        alone != tokens_of(run(make(folder), [SequenceState("p", tuple(ps[1]), GREEDY, 12)]))["p"]
    )
    first = SequenceState("g", tuple(ps[2]), GREEDY, 12)
    after = tokens_of(
        run(make(folder, max_num_seqs=1), [first, SequenceState("p", tuple(ps[1]), penalized, 12)])
    )
    assert after["p"] == alone


def test_a_config_without_a_chunk_takes_its_backends() -> None:
    """TPU reads every weight once a chunk: its chunks are 1,024 positions (bench/README.md,
    "TPU programs"); CPU 128 ("Prompt rows in the kernel"); a step takes a chunk beside
    every decode row."""
    unset = CoreConfig("m", max_num_seqs=8, chunk_size=None, max_num_batched_tokens=None)
    assert backend_shapes(unset, "tpu") == (1024, 1032)
    assert backend_shapes(unset, "cpu") == (128, 136)
    given = replace(unset, chunk_size=64, max_num_batched_tokens=100)
    assert backend_shapes(given, "tpu") == (64, 100)
