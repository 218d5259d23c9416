"""tokenization.grammar on GPT-2's real vocabulary: the mask layout is the engine's, the model's
vocabulary may be wider than the tokenizer's, compiled grammars are cached in a bounded LRU,
and a bad or oversized constraint is a GrammarError naming it."""

from __future__ import annotations

import json

import llguidance
import numpy as np
import pytest

from engine.token_mask import mask_words, token_bitmask
from tokenization import Tokenizer
from tokenization.grammar import MAX_SPEC_CHARS, GrammarCompiler, GrammarError, GrammarSpec

MODEL_VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 64, as checkpoints often are


@pytest.fixture(scope="module")
def compiler(gpt2: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(gpt2.hf, MODEL_VOCAB, gpt2.eos_token_ids, cache_size=2)


def allowed_ids(mask: np.ndarray) -> set[int]:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_the_mask_is_the_engines_layout(gpt2: Tokenizer, compiler: GrammarCompiler) -> None:
    """token t is bit t % 32 of word t // 32, as engine.sampling.token_bitmask packs it; checked
    against llguidance's one-byte-per-token mask."""
    grammar = compiler.compile(GrammarSpec.choice(["hello world", "help"]))
    mask = grammar.initial_mask()
    assert mask.dtype == np.int32 and mask.shape == (mask_words(MODEL_VOCAB),)
    ids = allowed_ids(mask)
    assert np.array_equal(token_bitmask(sorted(ids), MODEL_VOCAB), mask)
    start = grammar.matcher()._matcher  # the matcher at the start, as llguidance sees it
    bias = np.frombuffer(start.compute_logit_bias(), np.uint8)
    assert ids == set(np.flatnonzero(bias).tolist())
    assert {gpt2.decode([i]) for i in ids} >= {"hello", "help", "hel", "he", "h"}
    assert max(ids) < 50257  # ids the tokenizer lacks are never allowed


def test_a_matcher_advances_and_completes(gpt2: Tokenizer, compiler: GrammarCompiler) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"const": 1}},
        "required": ["a"],
        "additionalProperties": False,
    }
    grammar = compiler.compile(GrammarSpec.json_schema(schema))
    matcher = grammar.matcher()
    ids = gpt2.encode('{"a":1}', add_special_tokens=False)
    mask = np.empty_like(grammar.initial_mask())
    for token in ids[:-1]:
        assert not matcher.advance(token)
        matcher.fill_mask(mask)
        assert mask.any()
    assert matcher.advance(ids[-1])  # complete: nothing may follow
    with pytest.raises(GrammarError, match="rejected"):
        grammar.matcher().advance(gpt2.encode(" x", add_special_tokens=False)[0])


def accepts(gpt2: Tokenizer, compiler: GrammarCompiler, schema: object, text: str) -> bool:
    """Whether the schema's grammar takes `text` whole, token by token."""
    matcher = compiler.compile(GrammarSpec.json_schema(schema)).matcher()
    ids = gpt2.encode(text, add_special_tokens=False)
    try:
        return [matcher.advance(t) for t in ids][-1]
    except GrammarError:
        return False


NESTED = {
    "type": "object",
    "properties": {"a": {"type": "array", "items": {"type": "object", "properties": {"b": {}}}}},
}


@pytest.mark.parametrize("indent", [None, 2, 4])
def test_json_takes_what_a_pretty_printer_writes(
    gpt2: Tokenizer, compiler: GrammarCompiler, indent: int | str | None
) -> None:
    value = {"a": [{"b": [1, 2]}, {"b": {"c": None}}]}
    assert accepts(gpt2, compiler, NESTED, json.dumps(value, indent=indent))
    assert accepts(gpt2, compiler, NESTED, json.dumps(value, separators=(",", ":")))


@pytest.mark.parametrize(
    ("over", "within"),
    [
        ('{"a":  []}', '{"a": []}'),  # two blanks, one
        ('{"a":\n\n[]}', '{"a":\n[]}'),  # an empty line, a line break
        ('{"a": [1,\n' + " " * 17 + "2]}", '{"a": [1,\n' + " " * 16 + "2]}"),  # indents
        ('{"a":\n\t[]}', '{"a":\n []}'),  # a tab, a blank
        ('{"a": [] \n}', '{"a": []\n}'),  # a blank and a line break, a line break
    ],
)
def test_json_whitespace_is_bounded(
    gpt2: Tokenizer, compiler: GrammarCompiler, over: str, within: str
) -> None:
    """Each gap holds one blank, or a line break and an indent of at most 16 blanks, so a
    model cannot fill its budget with whitespace."""
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "number"}}}}
    assert accepts(gpt2, compiler, schema, within)
    assert not accepts(gpt2, compiler, schema, over)


def test_compiled_grammars_are_an_lru(compiler: GrammarCompiler) -> None:
    a, b, c = (GrammarSpec("regex", pattern) for pattern in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(a) is first
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recent
    compiler.compile(c)  # evicts b
    assert compiler.cached == 2 and compiler.compile(a) is first


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        (GrammarSpec("regex", "(unclosed"), "unclosed group"),
        (GrammarSpec.json_schema({"type": "objekt"}), "objekt"),
        (GrammarSpec("grammar", "start: undefined_rule"), "undefined_rule"),
        (GrammarSpec("regex", "x" * (MAX_SPEC_CHARS + 1)), "at most"),
        (GrammarSpec("json", json.dumps({"type": "array", "items": {}}) * 2), "invalid json"),
    ],
)
def test_bad_constraints_name_the_problem(
    compiler: GrammarCompiler, spec: GrammarSpec, named: str
) -> None:
    with pytest.raises(GrammarError, match=f"(?i){named}"):
        compiler.compile(spec)


def test_the_limits_are_llguidances_own() -> None:
    assert llguidance.LLParserLimits(max_grammar_size=7).max_grammar_size == 7
