"""TextStream: real tokenizers, stop strings spanning tokens, and the core's verdicts (a
stop token, EOS, the budget, a complete grammar) applied to the text."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenization import TextStream, Tokenizer

PROPERTY = settings(
    database=None,
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


Verdicts = dict[int, tuple[str, int | None]]  # position -> the core's (finish, stop token)


def run(
    stream: TextStream, ids: list[int], verdicts: Verdicts | None = None
) -> tuple[list[str], str | None, int | None]:
    deltas: list[str] = []
    for i, token_id in enumerate(ids):
        finish, stop_token = (verdicts or {}).get(i, (None, None))
        step = stream.add(token_id, finish=finish, stop_token=stop_token)
        deltas.append(step.text)
        if step.finished:
            return deltas, step.stop_str, step.stop_token
    final = stream.finish()
    deltas.append(final.text)
    return deltas, final.stop_str, final.stop_token


def tokens_spanned(tok: Tokenizer, text: str, start: int, end: int) -> int:
    """How many tokens carry (bytes of) the characters text[start:end]."""
    offsets = tok.hf.backend_tokenizer.encode(text, add_special_tokens=False).offsets
    return sum(1 for a, b in offsets if a < end and b > start)


def check_stop(tok: Tokenizer, text: str, stop: str, min_tokens: int) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    assert full == text
    start = full.index(stop)
    assert tokens_spanned(tok, text, start, start + len(stop)) >= min_tokens
    deltas, stop_str, stop_token = run(TextStream.of(tok, stop=[stop, "never-seen"]), ids)
    assert stop_str == stop and stop_token is None
    assert "".join(deltas) == full[:start]
    assert all("\ufffd" not in d for d in deltas)


def test_stop_spanning_tokens_gpt2(gpt2: Tokenizer):
    text = "Hello world, 日本語 is here 👍🏽 and more"
    check_stop(gpt2, text, "o wor", 2)
    check_stop(gpt2, text, "日", 2)
    check_stop(gpt2, text, "lo world, 日本", 3)
    check_stop(gpt2, text, "👍🏽 a", 3)


def test_stop_spanning_tokens_both_styles(byte_level: Tokenizer, sentencepiece: Tokenizer):
    for tok in (byte_level, sentencepiece):
        text = "The quick brown fox 日本語のテキスト STOP here 😀 end"
        check_stop(tok, text, "ck bro", 2)
        check_stop(tok, text, "テキスト ST", 3)
        check_stop(tok, text, "re 😀", 2)


@PROPERTY
@given(data=st.data())
def test_stop_strings_over_real_tokens(any_tokenizer: Tokenizer, data: st.DataObject):
    text = data.draw(st.text(st.sampled_from("ab cé日本😀👍🏽\n"), min_size=1, max_size=25))
    ids = any_tokenizer.encode(text, add_special_tokens=False)
    full = any_tokenizer.decode(ids)
    i = data.draw(st.integers(0, max(0, len(full) - 1)))
    stops = [
        full[i : i + data.draw(st.integers(1, 4))] or "x",
        data.draw(st.text("ab 日", max_size=3)),
    ]
    stops = [s for s in stops if s]
    found = [(full.find(s) + len(s), -len(s), s) for s in stops if s in full]
    deltas, stop_str, _ = run(TextStream.of(any_tokenizer, stop=stops), ids)
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert full.startswith(emitted)
    if found:
        end, _, stop = min(found)
        assert stop_str == stop and emitted == full[: end - len(stop)]
    else:
        assert stop_str is None and emitted == full


def test_stop_token_ends_without_its_text(gpt2: Tokenizer):
    head = gpt2.encode("Hello wor")
    ids = head + [50256] + gpt2.encode("ld")
    deltas, stop_str, stop_token = run(
        TextStream.of(gpt2, stop=["world"]), ids, {len(head): ("stop", 50256)}
    )
    assert stop_token == 50256 and stop_str is None
    assert "".join(deltas) == "Hello wor"  # the held "wor" is released at the stop token


def test_user_stop_token_and_partial_character(gpt2: Tokenizer):
    ids = gpt2.encode("ok 😀")
    stop_id = gpt2.encode(" fine")[0]
    stream = TextStream.of(gpt2)
    deltas, _, stop_token = run(
        stream, ids[:-1] + [stop_id, ids[-1]], {len(ids) - 1: ("stop", stop_id)}
    )
    assert stop_token == stop_id
    assert "".join(deltas) == gpt2.decode(ids[:-1])
    assert stream.finished and stream.add(ids[-1]).text == ""


def test_eos_is_text_unless_the_core_says_stop(gpt2: Tokenizer):
    ids = gpt2.encode("a") + [50256] + gpt2.encode("b")
    deltas, stop_str, stop_token = run(TextStream.of(gpt2), ids)
    assert (stop_str, stop_token) == (None, None)
    assert "".join(deltas) == "ab"


def test_finish_releases_held_stop_prefix(sentencepiece: Tokenizer):
    ids = sentencepiece.encode("fox ST", add_special_tokens=False)
    stream = TextStream.of(sentencepiece, stop=["STOP"])
    text = "".join(stream.add(i).text for i in ids)
    assert text == "fox "
    final = stream.finish()
    assert (final.text, final.finish_reason, final.stop_reason) == ("ST", "length", None)
    assert stream.finished


def test_include_stop_str_and_prompt_context(sentencepiece: Tokenizer):
    prompt = sentencepiece.encode("Say")
    ids = sentencepiece.encode("fox STOP here", add_special_tokens=False)
    stream = TextStream.of(sentencepiece, prompt, stop=["STOP"], include_stop_str_in_output=True)
    deltas, stop_str, _ = run(stream, ids)
    assert stop_str == "STOP" and "".join(deltas) == " fox STOP"


EOS = 50256  # GPT-2's <|endoftext|>, a special token: skipped in text


def finish_of(
    stream: TextStream, ids: list[int], verdicts: Verdicts | None = None
) -> tuple[str, str | None, str | int | None, int]:
    """(text, finish_reason, stop_reason, tokens consumed), the last id ending the budget
    unless `verdicts` end it earlier."""
    text = ""
    for i, token_id in enumerate(ids):
        finish, stop_token = (verdicts or {}).get(i, (None, None))
        if i == len(ids) - 1 and finish is None:
            finish = "length"
        step = stream.add(token_id, finish=finish, stop_token=stop_token)
        text += step.text
        if step.finished:
            return text, step.finish_reason, step.stop_reason, stream.tokens
    return text, None, None, stream.tokens


def test_eos_ends_with_stop_and_no_text(gpt2: Tokenizer):
    head = gpt2.encode("one two")
    ids = head + [EOS] + gpt2.encode(" three")
    stream = TextStream.of(gpt2)
    verdict = {len(head): ("stop", None)}
    assert finish_of(stream, ids, verdict) == ("one two", "stop", None, len(ids) - 1)


def test_a_complete_grammar_keeps_its_last_token_text(gpt2: Tokenizer):
    ids = gpt2.encode('{"a": 1}')
    stream = TextStream.of(gpt2)
    text = "".join(stream.add(t).text for t in ids[:-1])
    last = stream.add(ids[-1], finish="stop", done=True)
    assert text + last.text == '{"a": 1}' and (last.finish_reason, last.stop_reason) == (
        "stop",
        None,
    )


def test_the_last_token_ends_with_length_and_releases_held_text(sentencepiece: Tokenizer):
    ids = sentencepiece.encode("fox ST", add_special_tokens=False)
    stream = TextStream.of(sentencepiece, stop=["STOP"])
    assert finish_of(stream, ids) == ("fox ST", "length", None, len(ids))


def test_a_stop_string_completed_by_the_last_token_wins_over_length(gpt2: Tokenizer):
    ids = gpt2.encode("say hello world")
    stream = TextStream.of(gpt2, stop=["world"])
    assert finish_of(stream, ids) == ("say hello ", "stop", "world", len(ids))
