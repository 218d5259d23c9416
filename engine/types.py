"""Plain data every layer of the engine shares: sampling parameters, limits, logprobs,
structured-output constraints (as protocols), the engine's stats, and its errors.

Owns: these types, the rules each value must satisfy (SamplingParams' ranges,
EngineLimits.check, SamplingParams.check_vocab), and the names of the engine-side flag
choices (DTYPE_NAMES, QUANTIZATIONS, KV_CACHE_DTYPES). Nothing here touches a device, a
thread or a socket, nor imports JAX: the HTTP process reads it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

MAX_LOGPROBS = 20
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's limit on logprob_token_ids; the device arrays hold this many
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit); the device arrays hold this many
LOGIT_BIAS_LIMIT = 100.0  # each bias in [-100, 100], as OpenAI's


class EngineError(Exception):
    """Base class for errors the engine raises on purpose."""


class CheckpointError(EngineError, ValueError):
    """A checkpoint folder is missing a file, holds a corrupt one, or is unsupported."""


class SamplingError(EngineError, ValueError):
    """A sampling parameter the engine cannot honour; `param` names the request field."""

    def __init__(self, message: str, param: str):
        self.param = param
        super().__init__(message)


class PromptTooLongError(EngineError, ValueError):
    """A prompt does not fit the largest prefill bucket or the context.

    `param` names the request field to blame: "prompt" when the prompt alone is too
    long, "max_tokens" when the prompt fits but not with the completion asked for.
    """

    def __init__(self, message: str, prompt_tokens: int, limit: int, param: str = "prompt"):
        self.prompt_tokens = prompt_tokens
        self.limit = limit
        self.param = param
        super().__init__(message)


# The choices of the flags that name an engine-side format, here (JAX-free) so the HTTP
# process can check a flag at the edge without loading JAX:
DTYPE_NAMES = ("float32", "bfloat16")  # --dtype; engine.checkpoint maps them
QUANTIZATIONS = ("none", "int8")  # --quantization; engine.quant applies them
# the attention backend (engine.attention: "auto" is the platform's, "reference" the definition)
ATTENTION_BACKENDS = ("auto", "reference", "gpu-pallas", "gpu-xla")
# --kv-cache-dtype (vLLM's names); engine.attention.kv_dtype stores them, and a test holds
# its own tuple equal to this one
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class EngineLimits:
    """What a loaded engine can take, published once and asked by everyone.

    The server turns `check` into 400s at the edge; the core calls the same `check`
    when a request arrives (engine.core.loop), so the rule cannot drift.
    """

    max_model_len: int  # prompt + completion tokens
    max_prompt_len: int  # max_model_len - 1 (chunked), else min(largest bucket, that)
    vocab_size: int  # the model's: token ids and top_k are bounded by it

    def check(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """The completion's token budget: max_tokens, cut to the room the prompt leaves (as
        vLLM cuts it); PromptTooLongError when the prompt leaves none or max_tokens alone
        exceeds the context."""
        if prompt_tokens > self.max_prompt_len:
            raise PromptTooLongError(
                f"This model's maximum prompt length is {self.max_prompt_len} tokens. "
                f"However, your prompt has {prompt_tokens} tokens.",
                prompt_tokens,
                self.max_prompt_len,
            )
        room = self.max_model_len - prompt_tokens
        if max_tokens is None:
            return room
        if max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"max_tokens={max_tokens} cannot be greater than "
                f"max_model_len={self.max_model_len}. Please request fewer output tokens.",
                prompt_tokens,
                self.max_model_len,
                param="max_tokens",
            )
        return min(max_tokens, room)  # vLLM's: the context's end stops it ("length")


class ConstraintMatcher(Protocol):
    """One sample's place in its constraint (tokenization.grammar.GrammarMatcher).

    Driven by one thread: the engine core's scheduler.
    """

    def advance(self, token_id: int) -> bool:
        """Consume a sampled token; True when the output is complete. ValueError when the
        constraint rejects the token."""
        ...

    def fill_mask(self, out: Any) -> None:
        """The allowed next tokens into `out`, int32 words of the engine's bitmask layout."""
        ...

    def rollback(self, count: int) -> None:
        """Undo the last `count` tokens `advance` took (speculative drafts checked ahead)."""
        ...


class TokenConstraint(Protocol):
    """A compiled structured-output constraint (tokenization.grammar.CompiledGrammar), shared
    and never changed by the samples that follow it; opaque to the engine but for these."""

    @property
    def spec(self) -> tuple[str, str]:
        """(kind, text) it was compiled from (tokenization.grammar.GrammarSpec's fields)."""
        ...

    def initial_mask(self) -> Any:
        """int32 words: the tokens allowed first."""
        ...

    def matcher(self) -> ConstraintMatcher:
        """A fresh matcher at the start, for one sample."""
        ...


@dataclass(frozen=True)
class SamplingParams:
    """Per-sample sampling, applied on the device for each row of a step.

    temperature 0 is greedy. top_k 0 (or <0) and top_p 1.0 disable those
    filters. `seed` must be set by the time the engine sees it: the key of
    the i-th generated token is fold_in(PRNGKey(seed), i), i = 0 for the first,
    so a seeded sample is independent of its batch.
    `logprobs` None returns none; N in 0..20 returns the chosen token's
    logprob and the N most likely alternatives (of the raw, unscaled logits,
    as vLLM does). `logprob_token_ids` (vLLM's; with logprobs set, 1 to 128 ids)
    returns, instead of the N most likely, the logprobs of exactly these ids, from
    the same logits.
    `logit_bias` ((token id, bias) pairs, ids distinct) is added to the logits
    of every sampled position; `allowed_token_ids` (None: every token) restricts
    sampling to those ids. Both shape only what is sampled: logprobs stay those
    of the model's raw logits (vLLM's default logprobs mode).
    `repetition_penalty` (vLLM's and transformers'; 1: off) divides a positive logit and
    multiplies a negative one of every token in the prompt or the output so far, before the
    presence and frequency penalties (which count the output only) are subtracted.
    `constraint` (structured outputs) restricts every sampled token to those its
    grammar allows next, together with allowed_token_ids; the sample ends with
    "stop" as soon as the grammar is complete, whatever ignore_eos or min_tokens say
    (nothing else could follow).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    constraint: TokenConstraint | None = field(default=None, compare=False)
    logprob_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        """Every value must be one the device arrays hold exactly (float32, int32, 64-bit key)."""
        names = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
        for name in (*names, "repetition_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
                raise ValueError(f"{name} must be a finite float32 number, got {value}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not self.repetition_penalty > 0:
            raise SamplingError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                "repetition_penalty",
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        if not 0 <= self.min_tokens <= INT32_MAX:
            raise ValueError(f"min_tokens must be in 0..{INT32_MAX}, got {self.min_tokens}")
        if not -INT32_MAX <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must fit in int32, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must be a signed 64-bit integer, got {self.seed}")
        self._check_logit_bias()
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise SamplingError("allowed_token_ids must not be empty", "allowed_token_ids")
        self._check_logprob_token_ids()

    @property
    def penalized(self) -> bool:
        """A penalty reads the tokens before each position (presence, frequency, repetition)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    def _check_logprob_token_ids(self) -> None:
        """vLLM's rules: a non-empty list of at most MAX_LOGPROB_TOKEN_IDS, and logprobs set."""
        ids = self.logprob_token_ids
        if ids is None:
            return
        if not ids:
            raise SamplingError(
                "`logprob_token_ids` must not be an empty list.", "logprob_token_ids"
            )
        if len(ids) > MAX_LOGPROB_TOKEN_IDS:
            raise SamplingError(
                f"Requested logprob_token_ids of length {len(ids)}, which is greater than max "
                f"allowed: {MAX_LOGPROB_TOKEN_IDS}",
                "logprob_token_ids",
            )
        if self.logprobs is None:
            raise SamplingError(
                "when using `logprob_token_ids`, `logprobs` must be set (completions: "
                "logprobs; chat: logprobs true).",
                "logprob_token_ids",
            )

    def _check_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingError(
                f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}",
                "logit_bias",
            )
        ids = [token for token, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            raise SamplingError("logit_bias names a token id twice", "logit_bias")
        for token, bias in self.logit_bias:
            if not (math.isfinite(bias) and -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT):
                raise SamplingError(
                    f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], "
                    f"got {bias} for token {token}",
                    "logit_bias",
                )

    def check_vocab(self, vocab_size: int) -> None:
        """SamplingError when logit_bias, allowed_token_ids or logprob_token_ids names an id
        outside the vocabulary.

        The one owner of this rule inside the engine: the core asks it when a request
        arrives (engine.core.loop), before any device array is built; the server checks the
        same ids at the edge with vLLM's wording (server.params.check_vocab).
        """
        named = (
            ("logit_bias", [token for token, _ in self.logit_bias]),
            ("allowed_token_ids", list(self.allowed_token_ids or ())),
            ("logprob_token_ids", list(self.logprob_token_ids or ())),
        )
        for param, ids in named:
            bad = [token for token in ids if not 0 <= token < vocab_size]
            if bad:
                raise SamplingError(
                    f"{param} has token ids outside the vocabulary (0..{vocab_size - 1}): "
                    f"{bad[:5]}",
                    param,
                )


@dataclass(frozen=True)
class TokenLogprobs:
    """Host-side logprob data of one position: the chosen token and its alternatives (the
    most likely, best first; or with logprob_token_ids, those ids in the order asked)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters; /metrics reads it at scrape time."""

    waiting_requests: int  # sequences submitted and not yet scheduled (samples, not requests)
    running_requests: int  # sequences holding KV pages
    kv_pages_used: int  # pages some sequence holds
    kv_pages_total: int
    alive: bool
    draining: bool
    steps: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache (vLLM's meaning)
    prefix_hits: int = 0  # of those, found
    prefix_cached_pages: int = 0  # pages keeping a prefix block that no sequence holds
    preemptions: int = 0
    kv_cache_bytes: int = 0  # device memory of the KV pages, given once at start
    spec_drafts: int = 0  # speculative decoding: sequence-steps that proposed drafts
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()  # accepted drafts by their position
    weight_bytes: int = 0  # device memory of the params (int8 ones when quantized)
    # LoRA (vLLM's lora_requests_info): the adapters of running sequences, of waiting ones,
    # and how many adapters the device pool holds at once (0: LoRA off)
    lora: tuple[tuple[str, ...], tuple[str, ...], int] = ((), (), 0)
