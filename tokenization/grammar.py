"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar) as token masks.

Runs on: the server's tokenizer threads (`GrammarCompiler.compile`, before a request is
queued, so a bad constraint is a 400 before any stream starts) and the engine core's
loop (its own compiler; `GrammarMatcher`, one per sample, advanced by the scheduler).
Owns: the llguidance tokenizer built once from the checkpoint's fast tokenizer, a
bounded LRU of compiled grammars, and the resource limits that keep a pathological
schema or regex from holding a thread.

Why llguidance: it compiled a small JSON schema ~10x faster than xgrammar 0.2.9 here
(~1.2 ms vs ~15 ms on the gpt2 vocabulary; compilation sits on the request path),
bounds compilation and every mask step with explicit fuel limits (a limit hit is an
error we turn into a 400), releases the GIL, and needs no torch. xgrammar's mask was
faster per token (~5 us vs ~50-80 us), both far below a decode step.

Masks use the engine's layout: token t is bit t % 32 of int32 word t // 32, over the
model's vocabulary (which may be larger than the tokenizer's: the extra ids are never
allowed). JSON grammars allow between two tokens what a pretty-printer writes there (one
space, or a line break and an indent of at most 16 blanks), never a free run of
whitespace, and an object takes only the keys it lists unless it says otherwise
(tokenization.json_schema), so a model can neither fill its budget with blanks nor with
invented keys: the output of a small schema ends.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import llguidance.hf
import numpy as np

from tokenization.json_schema import closed

GrammarKind = Literal["json", "regex", "choice", "grammar"]
KINDS: tuple[GrammarKind, ...] = ("json", "regex", "choice", "grammar")
CACHE_SIZE = 128  # compiled grammars kept (LRU)
MAX_SPEC_CHARS = 65_536  # a schema, regex or grammar longer than this is refused
# Tighter than llguidance's defaults (a tenth to a half): compile in well under a second,
# a mask step in a few ms at worst, lexer memory within ~100 MB.
LIMITS = dict(
    max_items_in_row=2_000,
    initial_lexer_fuel=500_000,
    step_lexer_fuel=100_000,
    step_max_items=25_000,
    max_lexer_states=50_000,
    max_grammar_size=100_000,
    verbose_errors=False,  # errors name the problem, not the parser's state
)
# A model that writes JSON as `json.dumps(indent=2 or 4)` does keeps its layout: forbidding
# it made SmolLM2 close an object at once (`{}`) or run on in a number's digits where it
# wanted `, ` (a named tool call, 2 of 12 to the context's end). A gap stays bounded, so a
# random-weight model's objects end (tests/server/test_structured_ends.py). A schema's own
# `x-guidance` (llguidance's options) may say otherwise; the separators are always ours.
JSON_WHITESPACE = r"(\x20|\n\x20{0,16})?"
JSON_LAYOUT = {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
JSON_SEPARATORS = {"item_separator": ",", "key_separator": ":"}


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message names the problem (a 400)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asks its output to follow; `text` is the schema as JSON, the regex,
    the choices as a JSON list, or a Lark / GBNF grammar."""

    kind: GrammarKind
    text: str

    @classmethod
    def json_schema(cls, schema: Any) -> GrammarSpec:
        """A JSON schema (a dict, or a bool), its objects closed to the keys they list
        unless they say otherwise (tokenization.json_schema: vLLM's reading)."""
        return cls("json", json.dumps(closed(schema), separators=(",", ":")))

    @classmethod
    def choice(cls, options: list[str]) -> GrammarSpec:
        return cls("choice", json.dumps(options))


@dataclass(frozen=True)
class _Width:
    """Mask widths in int32 words: the engine's (the model's vocabulary) and llguidance's
    (at least the tokenizer's; ids past the model's are never produced, so dropped)."""

    words: int
    llg_words: int


class GrammarMatcher:
    """One sample's position in its grammar; used by one thread at a time (the grammar
    worker), so it needs no lock."""

    def __init__(self, matcher: llguidance.LLMatcher, width: _Width) -> None:
        self._matcher = matcher
        self._width = width

    def advance(self, token_id: int) -> bool:
        """Consume one sampled token; True when the output is complete (nothing may follow,
        or EOS ended it). GrammarError (a ValueError) when the grammar rejects the token."""
        if not self._matcher.consume_token(token_id):
            reason = self._matcher.get_error() or "the grammar had ended"
            raise GrammarError(f"the grammar rejected token {token_id}: {reason}")
        return bool(self._matcher.is_stopped())

    def fill_mask(self, out: np.ndarray) -> None:
        """The tokens allowed next, into `out` (int32 words, the engine's width)."""
        fill_mask(self._matcher, out, self._width)

    def rollback(self, count: int) -> None:
        """Undo the last `count` tokens consumed."""
        if count and not self._matcher.rollback(count):
            raise GrammarError(f"the grammar could not roll back {count} tokens")


class CompiledGrammar:
    """A compiled constraint, shared by every sample that asks for it: a matcher at the
    start and its first mask, computed once (samples get copies)."""

    def __init__(self, matcher: llguidance.LLMatcher, width: _Width, spec: GrammarSpec) -> None:
        self._start = matcher
        self._width = width
        self._spec = spec
        self._initial = np.zeros((width.words,), np.int32)
        fill_mask(matcher, self._initial, width)
        self._lock = threading.Lock()  # deep_copy reads the start state other threads share
        if not self._initial.any():
            raise GrammarError("the constraint allows no output at all")

    @property
    def spec(self) -> tuple[str, str]:
        """(kind, text): what it was compiled from, for an engine in another process."""
        return self._spec.kind, self._spec.text

    def initial_mask(self) -> np.ndarray:
        """Tokens allowed first (the prefill samples it); callers must not write to it."""
        return self._initial

    def matcher(self) -> GrammarMatcher:
        with self._lock:
            return GrammarMatcher(self._start.deep_copy(), self._width)


def fill_mask(matcher: llguidance.LLMatcher, out: np.ndarray, width: _Width) -> None:
    """Compute `matcher`'s next mask into `out` (contiguous int32, width.words long)."""
    if out.dtype != np.int32 or out.shape != (width.words,) or not out.flags["C_CONTIGUOUS"]:
        raise ValueError(f"a mask buffer must be contiguous int32 ({width.words},)")
    target = out if width.llg_words == width.words else np.zeros((width.llg_words,), np.int32)
    matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)
    if target is not out:
        out[:] = target[: width.words]
    error = matcher.get_error()
    if error:
        raise GrammarError(f"the grammar failed: {error}")


class GrammarCompiler:
    """Compiles GrammarSpecs against one tokenizer and vocabulary; thread-safe."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Collection[int],
        cache_size: int = CACHE_SIZE,
    ) -> None:
        n_vocab = max(vocab_size, len(hf_tokenizer))
        eos = sorted(eos_token_ids) or None
        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos)
        self.vocab_size = vocab_size
        self._width = _Width(words=-(-vocab_size // 32), llg_words=-(-n_vocab // 32))
        self._limits = llguidance.LLParserLimits(**LIMITS)  # type: ignore[arg-type]
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of `spec` (cached); GrammarError names what is wrong."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return cached
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    @property
    def cached(self) -> int:
        return len(self._cache)

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        if len(spec.text) > MAX_SPEC_CHARS:
            raise GrammarError(
                f"the {spec.kind} constraint is {len(spec.text)} characters; at most "
                f"{MAX_SPEC_CHARS} are allowed"
            )
        try:
            grammar = _grammar_text(spec)
        except (ValueError, RecursionError) as exc:
            raise GrammarError(f"invalid {spec.kind} constraint: {exc}") from exc
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, limits=self._limits, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {spec.kind} constraint: {matcher.get_error().strip()}")
        return CompiledGrammar(matcher, self._width, spec)


def _grammar_text(spec: GrammarSpec) -> str:
    if spec.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(
            spec.text,
            defaults=JSON_LAYOUT,  # type: ignore[arg-type]
            overrides=JSON_SEPARATORS,  # type: ignore[arg-type]
        )
    if spec.kind == "choice":
        options = json.loads(spec.text)
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        return llguidance.grammar_from("choice", spec.text)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    return llguidance.grammar_from("grammar", spec.text)
