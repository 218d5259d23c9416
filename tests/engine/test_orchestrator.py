"""The orchestrator on the fake engine: exact token order, finish rules, n > 1, logprobs.

Every expected token is computed by hand with engine.fake.fake_token, so a
token lost, duplicated or reordered anywhere between the stages fails a test.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator

import pytest

from engine.fake import FakeDelays, FakeEngine, FakeTokenizer, fake_logprob, fake_text, fake_token
from engine.orchestrator import Orchestrator, OrchestratorConfig, Unavailable
from engine.request import ActiveRequest, Delta
from engine.stages.detokenize import text_streams
from engine.types import PromptTooLongError, SamplingParams, TokenLogprobs

SEED_STRIDE = 1_000_003


def make(
    engine: FakeEngine | None = None,
    config: OrchestratorConfig | None = None,
    tokenizer: FakeTokenizer | None = None,
) -> Orchestrator:
    tokenizer = tokenizer or FakeTokenizer()
    return Orchestrator(
        engine or FakeEngine(),
        text_streams(tokenizer.detokenizer, tokenizer.eos_token_ids),
        config,
    )  # stop strings go through the real tokenization.StopMatcher


@pytest.fixture
def orch() -> Iterator[Orchestrator]:
    o = make()
    o.start()
    yield o
    o.stop()


def request(rid: str, prompt: tuple[int, ...], seed: int = 0, **kw: object) -> ActiveRequest:
    logprobs = kw.pop("logprobs", None)
    sampling = SamplingParams(temperature=0.0, seed=seed, logprobs=logprobs)  # type: ignore[arg-type]
    return ActiveRequest(request_id=rid, prompt_ids=prompt, sampling=sampling, **kw)  # type: ignore[arg-type]


def expected(prompt: tuple[int, ...], seed: int, count: int) -> list[int]:
    return [fake_token(prompt, seed, i) for i in range(count)]


def tokens_of(deltas: list[Delta], index: int = 0) -> list[int]:
    return [t for d in deltas if d.index == index for t in d.token_ids]


def text_of(deltas: list[Delta], index: int = 0) -> str:
    return "".join(d.text for d in deltas if d.index == index)


@pytest.mark.parametrize("run", range(4))
def test_many_requests_get_their_exact_tokens_in_order_under_random_delays(run: int) -> None:
    rng = random.Random(run)
    engine = FakeEngine(
        max_slots=8,
        delays=FakeDelays(prefill=(0, 0.002), insert=(0, 0.0005), generate=(0, 0.001)),
        seed=run,
    )
    config = OrchestratorConfig(max_queued_samples=256, prefill_queue_size=3)
    o = make(engine, config, FakeTokenizer(delay_s=0.0002))
    o.start()
    try:
        cases = []
        for i in range(200):
            prompt = tuple(rng.randrange(1000) for _ in range(rng.randint(1, 40)))
            cases.append((f"r{i}", prompt, rng.randrange(2**31), rng.randint(1, 24)))
        streams = {}

        def submit(chunk: list[tuple[str, tuple[int, ...], int, int]]) -> None:
            for rid, prompt, seed, max_tokens in chunk:
                streams[rid] = o.submit(request(rid, prompt, seed, max_tokens=max_tokens))

        submitters = [threading.Thread(target=submit, args=(cases[k::4],)) for k in range(4)]
        for t in submitters:
            t.start()
        for t in submitters:
            t.join()
        for rid, prompt, seed, max_tokens in cases:
            deltas = streams[rid].collect(timeout=30)
            want = expected(prompt, seed, max_tokens)
            assert tokens_of(deltas) == want, rid
            assert text_of(deltas) == "".join(fake_text(t) for t in want)
            assert [d.completion_tokens for d in deltas] == list(range(1, max_tokens + 1))
            assert [d.finish_reason for d in deltas] == [None] * (max_tokens - 1) + ["length"]
            assert all(d.prompt_tokens == len(prompt) for d in deltas)
        _wait_idle(o)
    finally:
        o.stop()


def _wait_idle(o: Orchestrator, timeout: float = 2.0) -> None:
    deadline = threading.Event()
    for _ in range(int(timeout / 0.01)):
        s = o.stats()
        if s.slots_in_use == 0 and s.running_requests == 0 and s.queued_requests == 0:
            return
        deadline.wait(0.01)
    raise AssertionError(f"orchestrator not idle: {o.stats()}")


def test_eos_ends_with_stop_and_no_text_unless_ignored() -> None:
    prompt = (5, 6, 7)
    want = expected(prompt, 1, 12)
    eos = want[3]
    assert eos not in want[:3]
    o = make(tokenizer=FakeTokenizer(eos_token_ids=frozenset({eos})))
    o.start()
    try:
        deltas = o.submit(request("a", prompt, 1, max_tokens=12)).collect(timeout=5)
        assert tokens_of(deltas) == want[:4]
        last = deltas[-1]
        assert (last.finish_reason, last.stop_reason, last.text) == ("stop", None, "")
        assert text_of(deltas) == "".join(fake_text(t) for t in want[:3])
        ignored = o.submit(request("b", prompt, 1, max_tokens=12, ignore_eos=True))
        deltas = ignored.collect(timeout=5)
        assert tokens_of(deltas) == want
        assert deltas[-1].finish_reason == "length"
    finally:
        o.stop()


def test_stop_token_id_ends_with_stop_reason_the_id(orch: Orchestrator) -> None:
    prompt = (9, 9)
    want = expected(prompt, 3, 10)
    stop_id = want[5]
    deltas = orch.submit(request("a", prompt, 3, max_tokens=10, stop_token_ids=(stop_id,))).collect(
        timeout=5
    )
    assert tokens_of(deltas) == want[: want.index(stop_id) + 1]
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason, deltas[-1].text) == (
        "stop",
        stop_id,
        "",
    )


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_with_stop_and_holds_back_the_match(
    orch: Orchestrator, include: bool
) -> None:
    prompt = (1, 2, 3, 4)
    want = expected(prompt, 0, 10)
    stop = fake_text(want[4])[:-1] + ">" + fake_text(want[5])[:2]  # spans tokens 4 and 5
    deltas = orch.submit(
        request("a", prompt, 0, max_tokens=10, stop=(stop,), include_stop_str_in_output=include)
    ).collect(timeout=5)
    assert tokens_of(deltas) == want[:6]
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop)
    before = "".join(fake_text(t) for t in want[:4])
    assert text_of(deltas) == before + (stop if include else "")


def test_stop_string_tail_is_flushed_when_length_ends_the_request(orch: Orchestrator) -> None:
    prompt = (4, 4)
    want = expected(prompt, 0, 3)
    held = fake_text(want[2]) + "never"  # the last token's text is a prefix of a stop string
    deltas = orch.submit(request("a", prompt, 0, max_tokens=3, stop=(held,))).collect(timeout=5)
    assert deltas[-1].finish_reason == "length"
    assert text_of(deltas) == "".join(fake_text(t) for t in want)


def test_context_end_finishes_with_length_without_overrunning_the_cache() -> None:
    engine = FakeEngine(max_slots=2, max_model_len=32, prefill_buckets=(8, 16, 31))
    o = make(engine)
    o.start()
    try:
        prompt = tuple(range(1, 11))
        deltas = o.submit(request("a", prompt, 2, max_tokens=None)).collect(timeout=5)
        assert tokens_of(deltas) == expected(prompt, 2, 22)
        assert deltas[-1].finish_reason == "length"
        assert o.alive  # the fake raises if a slot is stepped past max_model_len
    finally:
        o.stop()


def test_n_samples_prefill_once_and_each_follow_their_own_seed() -> None:
    engine = FakeEngine(max_slots=4)
    o = make(engine)
    o.start()
    try:
        prompt = (3, 1, 4, 1, 5)
        deltas = o.submit(request("a", prompt, 42, max_tokens=6, n=3)).collect(timeout=5)
        for i in range(3):
            assert tokens_of(deltas, i) == expected(prompt, (42 + i * SEED_STRIDE) % 2**31, 6)
            finals = [d for d in deltas if d.index == i and d.finish_reason]
            assert [d.finish_reason for d in finals] == ["length"]
        assert (engine.prefill_calls, engine.resample_calls) == (1, 2)
    finally:
        o.stop()


def test_n_larger_than_slots_and_prefill_queue_still_completes() -> None:
    o = make(FakeEngine(max_slots=2), OrchestratorConfig(prefill_queue_size=1))
    o.start()
    try:
        deltas = o.submit(request("a", (8, 8), 7, max_tokens=4, n=5)).collect(timeout=5)
        assert sorted({d.index for d in deltas}) == list(range(5))
        assert all(len(tokens_of(deltas, i)) == 4 for i in range(5))
    finally:
        o.stop()


def test_logprobs_and_prompt_logprobs(orch: Orchestrator) -> None:
    prompt = (10, 20, 30)
    deltas = orch.submit(
        request("a", prompt, 0, max_tokens=3, logprobs=2, prompt_logprobs=2)
    ).collect(timeout=5)
    for d in deltas:
        (t,) = d.token_ids
        assert d.logprobs == (TokenLogprobs(t, fake_logprob(t), ((t, 0.0), (t + 1, -0.125))),)
    assert deltas[0].prompt_logprobs == (
        None,
        TokenLogprobs(20, fake_logprob(20)),
        TokenLogprobs(30, fake_logprob(30)),
    )
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    plain = orch.submit(request("b", prompt, 0, max_tokens=2)).collect(timeout=5)
    assert all(d.logprobs is None and d.prompt_logprobs is None for d in plain)


def test_unseeded_requests_draw_different_seeds() -> None:
    o = make(FakeEngine(vocab_size=1_000_003))
    o.start()
    try:
        sampling = SamplingParams(temperature=1.0)
        outs = [
            tokens_of(o.submit(ActiveRequest(f"r{i}", (1, 2), sampling, 4)).collect(timeout=5))
            for i in range(2)
        ]
        assert outs[0] != outs[1]
    finally:
        o.stop()


def test_async_consumer_in_a_running_loop(orch: Orchestrator) -> None:
    async def consume() -> list[list[int]]:
        streams = [orch.submit(request(f"r{i}", (i + 1,), i, max_tokens=5)) for i in range(6)]

        async def tokens(stream: object) -> list[int]:
            return [t async for d in stream for t in d.token_ids]  # type: ignore[attr-defined]

        return await asyncio.gather(*(tokens(s) for s in streams))

    results = asyncio.run(consume())
    assert results == [expected((i + 1,), i, 5) for i in range(6)]


def test_timings_are_ordered(orch: Orchestrator) -> None:
    stream = orch.submit(request("a", (1, 2, 3), 0, max_tokens=5))
    deltas = stream.collect(timeout=5)
    t = stream.timings
    assert t.prefill_start is not None and t.prefill_end is not None and t.inserted is not None
    assert t.first_token is not None and t.finished is not None
    assert t.queued <= t.prefill_start <= t.prefill_end <= t.inserted <= t.first_token
    times = [d.emitted for d in deltas]
    assert len(times) == 5 and times == sorted(times) and times[0] == t.first_token
    assert times[-1] <= t.finished


def test_submit_validates_requests(orch: Orchestrator) -> None:
    with pytest.raises(PromptTooLongError):
        orch.submit(request("a", tuple(range(129)), max_tokens=1))  # largest bucket is 128
    with pytest.raises(PromptTooLongError):
        orch.submit(request("b", tuple(range(100)), max_tokens=157))  # 257 > max_model_len
    orch.submit(request("c", tuple(range(100)), max_tokens=156)).collect(timeout=5)
    orch.submit(request("d", (1,), max_tokens=50))
    with pytest.raises(ValueError, match="already in use"):
        orch.submit(request("d", (1,), max_tokens=1))
    with pytest.raises(ValueError):
        request("e", ())
    with pytest.raises(ValueError):
        request("e", (1,), n=0)


def test_submit_before_start_and_after_stop_is_unavailable() -> None:
    o = make()
    with pytest.raises(Unavailable):
        o.submit(request("a", (1,)))
    o.start()
    o.stop()
    with pytest.raises(Unavailable):
        o.submit(request("a", (1,)))


def test_orchestrator_modules_import_no_server_or_prometheus_code() -> None:
    import ast
    from pathlib import Path

    import engine

    root = Path(engine.__file__).parent
    files = [root / "orchestrator.py", root / "request.py", root / "fake.py"]
    files += sorted((root / "stages").glob("*.py"))
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert not name.startswith(("server", "prometheus")), (path.name, name)
