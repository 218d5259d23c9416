"""One workload through both sides: the core decides every token rule (EOS, stop ids after
min_tokens, the budget; engine.core.rules), the HTTP side (frontend.output over
tokenization.TextStream) only turns its verdicts into text; what a client gets must be
what the core decided, and both must follow vLLM's min_tokens rule."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.messages import Outputs, Stats, TokenOut
from engine.core.rules import finish_reason
from engine.core.sequence import SequenceState
from engine.types import SamplingParams
from frontend.input import add_request, sample_samplings
from frontend.output import OutputProcessor
from frontend.request import ActiveRequest, Delta
from frontend.text import text_streams
from tests.tokenization.conftest import gpt2, gpt2_dir  # noqa: F401 (fixtures)
from tokenization import Tokenizer
from tokenization.detokenizer import IncrementalDetokenizer

EOS = 50256  # GPT-2's <|endoftext|>
STATS = Stats(0, 0, 1, 1, 0, 0, 0, 0, 0)
PROPERTY = settings(
    database=None,
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def core_side(
    ids: list[int], min_tokens: int, budget: int, stop_ids: frozenset[int], eos: frozenset[int]
) -> list[TokenOut]:
    """The tokens the core sends for these sampled ids, each with its verdict."""
    sampling = SamplingParams(seed=0, min_tokens=min_tokens)
    seq = SequenceState("0:r", (1,), sampling, budget, stop_token_ids=stop_ids, eos_token_ids=eos)
    outs = []
    for token in ids:
        seq.append(token)
        finish, stop_reason = finish_reason(seq, token, max_model_len=1 << 20)
        outs.append(TokenOut("r", 0, token, 0.0, finish=finish, stop_reason=stop_reason))
        if finish is not None:
            break
    return outs


def http_side(tok: Tokenizer, outs: list[TokenOut], min_tokens: int, budget: int) -> list[Delta]:
    def detokenizer(prompt: tuple[int, ...], skip: bool) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)

    out = OutputProcessor(text_streams(detokenizer), lambda message: None, 16)
    out.refuse(None)
    request = ActiveRequest("r", (1,), SamplingParams(seed=0, min_tokens=min_tokens), budget)
    samplings = sample_samplings(request)
    stream = out.open(request, samplings, add_request(request, samplings))
    out.take(Outputs(tuple(outs), STATS))
    assert stream.finished  # the core ended the sample, and so the request
    return list(stream)


def expected_end(ids: list[int], min_tokens: int, budget: int, stops: frozenset[int]) -> int:
    """vLLM's rule, independently: a stop token at 0-based position i ends the sample when
    at least min_tokens tokens came before it (i >= min_tokens); else the budget does."""
    for i, token in enumerate(ids[:budget]):
        if token in stops and i >= min_tokens:
            return i
    return budget - 1


def test_a_stop_token_as_the_min_tokens_th_token_does_not_end_the_sample(gpt2: Tokenizer):  # noqa: F811
    """The case the two sides once decided apart: with min_tokens 2, a stop id as the 2nd
    token is text; as the 3rd it ends the sample (two tokens before it)."""
    word, stop = gpt2.encode(" x")[0], gpt2.encode(" y")[0]
    ids = [word, stop, stop, word]
    outs = core_side(ids, 2, 10, frozenset({stop}), frozenset())
    assert [o.finish for o in outs] == [None, None, "stop"] and outs[-1].stop_reason == stop
    deltas = http_side(gpt2, outs, 2, 10)
    assert "".join(d.text for d in deltas) == " x y"
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop)
    assert deltas[-1].completion_tokens == 3


@PROPERTY
@given(data=st.data())
def test_the_client_gets_what_the_core_decided(gpt2: Tokenizer, data: st.DataObject):  # noqa: F811
    words = gpt2.encode(" the cat sat on a mat 日本 👍")
    user_stop = words[1]
    ids = data.draw(st.lists(st.sampled_from([*words, EOS]), min_size=1, max_size=30))
    min_tokens = data.draw(st.integers(0, 8))
    budget = data.draw(st.integers(1, len(ids)))
    ignore_eos = data.draw(st.booleans())
    eos = frozenset() if ignore_eos else frozenset({EOS})
    outs = core_side(ids, min_tokens, budget, frozenset({user_stop}), eos)
    deltas = http_side(gpt2, outs, min_tokens, budget)

    end = expected_end(ids, min_tokens, budget, frozenset({user_stop}) | eos)
    last = outs[-1]
    assert len(outs) == end + 1 and last.finish is not None
    by_token = last.finish == "stop"
    assert by_token == (ids[end] in (frozenset({user_stop}) | eos) and end >= min_tokens)
    # the client's view is the core's verdict, with the text of the tokens before a stop
    # token (or all of them when the budget ended it)
    final = deltas[-1]
    assert (final.finish_reason, final.stop_reason) == (last.finish, last.stop_reason)
    assert final.completion_tokens == len(outs)
    text = "".join(d.text for d in deltas)
    assert text == gpt2.decode(ids[:end] if by_token else ids[: end + 1])
    if by_token:
        assert last.stop_reason == (ids[end] if ids[end] == user_stop else None)
