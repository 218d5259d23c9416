"""IncrementalDetokenizer: deltas join to the full decode, never a broken character.

Property tests run over random Unicode text (emoji with ZWJ and skin tones, CJK,
combining marks, RTL, control characters) encoded by both tokenizer styles and GPT-2,
and over random token-id sequences biased towards lone byte tokens and specials.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenization import IncrementalDetokenizer, Tokenizer
from tokenization.byte_decoding import DecoderStyle

PROPERTY = settings(
    database=None,
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

PIECES = [
    "👨‍👩‍👧‍👦", "👍🏽", "👍🏿", "🏳️‍🌈", "🇯🇵", "😀", "e\u0301", "a\u0308\u0323", "日本語", "中文",
    "한국어", "שלום", "مرحبا", "\u200f", "\u200d", "\ufeff", " ", "  ", "\n", "\t", "\x00", "\x7f",
    "\x1b[0m", "Hello", " world", "é", "€", "\ufffd", "<s>", "</s>", "<|endoftext|>",
]  # fmt: skip

unicode_text = st.lists(
    st.one_of(
        st.sampled_from(PIECES),
        st.text(st.characters(codec="utf-8"), max_size=4),
        st.text(st.characters(min_codepoint=0x4E00, max_codepoint=0x4E40), max_size=3),
        st.text(st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF), max_size=3),
    ),
    max_size=12,
).map("".join)


def run(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str]:
    """Deltas after each token, and the final flush."""
    return [detok.add(i) for i in ids], detok.flush()


def settled(tok: Tokenizer, ids: list[int]) -> bool:
    """Whether decode(ids) can no longer change whatever tokens follow (no pending bytes)."""
    kept = [i for i in ids if i not in tok.special_token_ids]
    if not kept:
        return True
    if tok.style is DecoderStyle.BYTE_FALLBACK:
        return kept[-1] not in tok.byte_token_ids
    tail = b"".join(tok.token_bytes(i) for i in kept[-4:])
    for cut in range(1, min(4, len(tail)) + 1):
        try:
            tail[-cut:].decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.reason == "unexpected end of data" and exc.start == 0:
                return False
    return True


def check_stream(tok: Tokenizer, ids: list[int]) -> None:
    full = tok.decode(ids)
    deltas, tail = run(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) + tail == full
    emitted = ""
    for n, delta in enumerate(deltas, start=1):
        delta.encode("utf-8")  # valid UTF-8: no lone surrogates
        for j, ch in enumerate(delta):
            if ch == "\ufffd":
                assert full[len(emitted) + j] == "\ufffd"
        emitted += delta
        # Nothing is held back once the text so far can no longer change.
        if settled(tok, ids[:n]):
            assert emitted == tok.decode(ids[:n]), (n, emitted)


@PROPERTY
@given(text=unicode_text)
def test_text_streams_exactly(any_tokenizer: Tokenizer, text: str):
    ids = any_tokenizer.encode(text, add_special_tokens=False)
    if any_tokenizer.style is DecoderStyle.BYTE_LEVEL:
        assert any_tokenizer.decode(ids, skip_special_tokens=False) == text
    check_stream(any_tokenizer, ids)
    deltas, tail = run(IncrementalDetokenizer(any_tokenizer), ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas) and "\ufffd" not in tail


@st.composite
def token_ids(draw: st.DrawFn, tok: Tokenizer) -> list[int]:
    byte_ids = sorted(tok.byte_token_ids) or list(range(256))
    specials = sorted(tok.special_token_ids)
    one = st.one_of(
        st.integers(0, tok.vocab_size - 1),
        st.sampled_from(byte_ids),
        st.sampled_from(byte_ids[0x80:] if len(byte_ids) == 256 else byte_ids),
        st.sampled_from(specials),
    )
    return draw(st.lists(one, max_size=30))


@PROPERTY
@given(data=st.data())
def test_random_ids_stream_exactly(any_tokenizer: Tokenizer, data: st.DataObject):
    check_stream(any_tokenizer, data.draw(token_ids(any_tokenizer)))


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece", "gpt2"])
def test_special_tokens_kept_when_asked(request: pytest.FixtureRequest, name: str):
    tok: Tokenizer = request.getfixturevalue(name)
    special = min(tok.special_token_ids)
    ids = tok.encode("Hi ", add_special_tokens=False) + [special]
    ids += tok.encode("there 😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == tok.decode(ids, skip_special_tokens=False)
    assert tok.hf.convert_ids_to_tokens(special) in text


def test_emoji_is_never_streamed_broken(gpt2: Tokenizer):
    ids = gpt2.encode("I like 👨‍👩‍👧‍👦 and 日本語")
    deltas, tail = run(IncrementalDetokenizer(gpt2), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "👨‍👩‍👧‍👦" in "".join(deltas)
    assert deltas.count("") > 0  # partial bytes really were held back
    assert tail == ""


def test_trailing_partial_character_flushes_as_full_decode(gpt2: Tokenizer):
    ids = gpt2.encode("ok 😀")[:-1]
    deltas, tail = run(IncrementalDetokenizer(gpt2), ids)
    assert "".join(deltas) == "ok"
    assert tail == gpt2.decode(ids)[2:] and tail.endswith("\ufffd")


def test_sentencepiece_leading_space_from_prompt_context(sentencepiece: Tokenizer):
    prompt = sentencepiece.encode("Hello")
    generated = sentencepiece.encode("world 日本", add_special_tokens=False)
    detok = IncrementalDetokenizer(sentencepiece, prompt)
    text = "".join(detok.add(i) for i in generated) + detok.flush()
    assert text == " world 日本"
    alone = IncrementalDetokenizer(sentencepiece)
    assert "".join(alone.add(i) for i in generated) + alone.flush() == "world 日本"


@PROPERTY
@given(prompt=unicode_text, completion=unicode_text)
def test_prompt_context_gives_the_continuation(
    any_tokenizer: Tokenizer, prompt: str, completion: str
):
    prompt_ids = any_tokenizer.encode(prompt)
    ids = any_tokenizer.encode(completion, add_special_tokens=False)
    detok = IncrementalDetokenizer(any_tokenizer, prompt_ids)
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    # A prompt tail whose text is not final yet is not context; the rest is.
    context = list(prompt_ids)
    while context and not settled(any_tokenizer, context):
        context.pop()
    context_text = any_tokenizer.decode(context)
    full = any_tokenizer.decode(context + ids)
    assert full.startswith(context_text)
    assert text == full[len(context_text) :]


def test_prompt_ending_mid_character(gpt2: Tokenizer, sentencepiece: Tokenizer):
    for tok in (gpt2, sentencepiece):
        prompt = tok.encode("Say 😀")
        cut = next(n for n in range(len(prompt) - 1, 0, -1) if settled(tok, prompt[:n]))
        generated = tok.encode(" ok", add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt[: cut + 1])
        text = "".join(detok.add(i) for i in generated) + detok.flush()
        assert text == tok.decode(prompt[:cut] + generated)[len(tok.decode(prompt[:cut])) :]
        assert "\ufffd" not in text


def test_window_stays_small(gpt2: Tokenizer):
    """Per-token work is a decode of a few recent tokens, not of the whole sequence."""
    ids = gpt2.encode("The quick brown fox 🦊 jumps over the lazy dog. " * 60)
    detok = IncrementalDetokenizer(gpt2, ids[:20])
    widths: list[int] = []
    original = detok._decode

    def spy(window: list[int], **kwargs: bool) -> str:
        widths.append(len(window))
        return original(window, **kwargs)

    detok._decode = spy  # type: ignore[method-assign]
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == gpt2.decode(ids[:20] + ids)[len(gpt2.decode(ids[:20])) :]
    assert len(ids) > 600 and max(widths) <= 6
    assert len(detok._ids) <= 300


@PROPERTY
@given(text=unicode_text, data=st.data())
def test_decoder_without_bytes(metaspace: Tokenizer, text: str, data: st.DataObject):
    """A tokenizer with neither byte table nor byte fallback (unknown text becomes <unk>)."""
    assert metaspace.style is DecoderStyle.OTHER
    check_stream(metaspace, metaspace.encode(text, add_special_tokens=False))
    check_stream(metaspace, data.draw(st.lists(st.integers(0, metaspace.vocab_size - 1))))


def test_llama_tokenizer_class(llama_class_dir: Path):
    tok = Tokenizer.from_folder(llama_class_dir)
    assert tok.style is DecoderStyle.BYTE_FALLBACK and tok.bos_token_id == 1
    text = "Hello 日本語 👨‍👩‍👧‍👦 café"
    ids = tok.encode(text)
    assert ids == tok.hf.encode(text) and ids[0] == 1 and tok.decode(ids) == text
    check_stream(tok, ids)
    prompt = tok.encode("Say")
    detok = IncrementalDetokenizer(tok, prompt)
    out = "".join(detok.add(i) for i in ids[1:]) + detok.flush()
    assert out == tok.decode(prompt + ids[1:])[len(tok.decode(prompt)) :]
