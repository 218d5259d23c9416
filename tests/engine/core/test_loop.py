"""engine.core.loop on the real tiny model: the loop with one step in flight (async
scheduling: step N + 1 planned and dispatched before step N is waited for, its decode
rows fed on the device) gives every sample the tokens and logprob bits the loop gives
with one step at a time, through arrivals, queueing, stop tokens, max_tokens, prompt
logprobs, penalties, a grammar, preemption and aborts; and it does run ahead."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from engine.core.core import CoreConfig, EngineCore
from engine.core.loop import Core, CoreLoop, P
from engine.core.messages import (
    Abort,
    AddRequest,
    FromCore,
    Grammar,
    Outputs,
    Sample,
    Stop,
    ToCore,
)
from engine.types import SamplingParams, TokenConstraint
from tests.engine.core.test_core import Only

GREEDY = SamplingParams(temperature=0.0, seed=0)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, logprobs=2)
PENALIZED = SamplingParams(temperature=0.0, seed=0, frequency_penalty=2.0, presence_penalty=1.0)

Script = dict[int, list[ToCore]]  # receive call -> the messages it returns
# (token, logprob where it asked for logprobs, finish reason)
Got = dict[tuple[str, int], list[tuple[int, float | None, str | None]]]


def make(folder, ahead: bool, **options) -> EngineCore:  # type: ignore[no-untyped-def]
    config = dict(
        model_path=folder, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32,
        chunk_size=16, page_size=8, num_pages=64, async_scheduling=ahead,
    )  # fmt: skip
    return EngineCore(CoreConfig(**(config | options)))


def drive(
    core: Core[P],
    script: Script,
    grammar: Callable[[str, str], TokenConstraint] | None = None,
) -> tuple[Got, CoreLoop[P]]:
    """Run the loop over the scripted messages (each returned by that receive call; Stop
    once the script is spent and nothing runs): every sample's tokens in order."""
    calls = 0
    outputs: list[Outputs] = []

    def receive(block: bool) -> list[ToCore]:
        nonlocal calls
        messages = script.pop(calls, [])
        calls += 1
        if block and not script:
            return [*messages, Stop()]
        if block and not messages:  # nothing runs: the next scripted messages come now
            calls = min(script)
            return receive(block)
        return messages

    def send(message: FromCore) -> None:
        assert isinstance(message, Outputs)
        assert not message.rejected, message.rejected
        outputs.append(message)

    loop = CoreLoop(core, receive, send, grammar)
    loop.run()
    got: Got = {}
    for message in outputs:
        for t in message.tokens:
            # a logprob is computed only in steps where some row asked for logprobs
            logprob = t.logprob if t.top else None
            got.setdefault((t.request_id, t.index), []).append((t.token, logprob, t.finish))
    return got, loop


def request(
    rid: str,
    prompt: list[int],
    sampling: SamplingParams,
    max_tokens: int,
    n: int = 1,
    **options,  # type: ignore[no-untyped-def]
) -> AddRequest:
    samples = tuple(Sample.of(replace(sampling, seed=(sampling.seed or 0) + i)) for i in range(n))
    options = {"stop_token_ids": (), "ignore_eos": True} | options  # no EOS: the ids it is given
    return AddRequest(rid, tuple(prompt), samples, max_tokens, **options)


def prompts(vocab: int, count: int = 8) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, vocab, int(n)).tolist() for n in rng.integers(3, 70, count)]


@pytest.fixture(scope="module")
def folder(tiny_checkpoint_of):  # type: ignore[no-untyped-def]
    return tiny_checkpoint_of("llama")


def workload(vocab: int, stop: int | None) -> Script:
    ps = prompts(vocab)
    stops = () if stop is None else (stop,)
    return {
        0: [
            request("a", ps[0], GREEDY, 20, stop_token_ids=stops),
            request("b", ps[1], SEEDED, 9, n=2),
            request("c", ps[2], PENALIZED, 14),
        ],
        2: [request("d", ps[3], GREEDY, 30, prompt_logprobs=2)],  # arrives mid-run
        3: [request("e", ps[4], SEEDED, 11), request("f", ps[5], GREEDY, 1)],  # queued
        9: [request("g", ps[6], GREEDY, 25, stop_token_ids=stops)],
        14: [request("h", ps[7], replace(SEEDED, min_tokens=4), 7, stop_token_ids=stops)],
    }


def test_one_step_in_flight_gives_the_tokens_of_one_step_at_a_time(folder) -> None:  # type: ignore[no-untyped-def]
    vocab = make(folder, False).model_config.vocab_size
    free, _ = drive(make(folder, False), workload(vocab, None))
    # a stop token that ends "a" mid-run (rows of it already planned ahead) and may end
    # others anywhere
    stop = free[("a", 0)][6][0]
    want, _ = drive(make(folder, False), workload(vocab, stop))
    assert want[("a", 0)][-1][2] == "stop" and len(want[("a", 0)]) < 20
    core = make(folder, True)
    got, loop = drive(core, workload(vocab, stop))
    assert got == want  # tokens, logprob bits and finish reasons, every sample
    assert loop.counters.ahead >= loop.counters.steps // 2  # it ran ahead most steps
    stats = core.page_stats()
    assert stats.free == stats.total and not core.scheduler.running


def test_preemption_a_grammar_and_an_abort_with_one_step_in_flight(folder) -> None:  # type: ignore[no-untyped-def]
    vocab = make(folder, False).model_config.vocab_size
    ps = [p[:30] for p in prompts(vocab)]
    only = Only([11, 12, 13], 6, vocab)

    def run(ahead: bool, abort: bool) -> tuple[Got, CoreLoop, EngineCore]:
        script: Script = {
            0: [request(k, ps[i], SEEDED, 24) for i, k in enumerate("abc")],
            1: [request("g", ps[3], GREEDY, 30, grammar=Grammar("regex", "x"))],  # fits 64
            4: [request("d", ps[4], GREEDY, 24)],
        }
        if abort:
            script[6] = [Abort((("b", 0),))]
        core = make(folder, ahead, num_pages=16, max_model_len=64)  # some are preempted
        got, loop = drive(core, script, lambda kind, text: only)
        return got, loop, core

    want, _, _ = run(False, abort=True)
    got, loop, core = run(True, abort=True)
    assert core.scheduler.preemptions > 0 and loop.counters.ahead > 0
    assert {k: v for k, v in got.items() if k[0] != "b"} == {
        k: v for k, v in want.items() if k[0] != "b"
    }
    grammar = [t for t, _, _ in got[("g", 0)]]
    assert len(grammar) == 6 and set(grammar) <= {11, 12, 13}
    # the aborted sample's tokens are those it gets unaborted, and it ended early
    full, _, _ = run(True, abort=False)
    assert got[("b", 0)] == full[("b", 0)][: len(got[("b", 0)])]
    assert len(got[("b", 0)]) < len(full[("b", 0)]) == 24
    stats = core.page_stats()
    assert stats.free == stats.total and not core.scheduler.running
