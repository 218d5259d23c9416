"""Data that crosses the seam between the slot engine and the orchestrator.

The orchestrator speaks to the engine only through `EngineProtocol`:
`prefill` -> `insert(prefix, state, slot)` -> `generate(state)`. Everything
here is plain data; device arrays stay device arrays until the detokenize
stage copies them to the host, so the generate loop never waits on a copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

MAX_LOGPROBS = 20
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


DTYPE_NAMES = ("float32", "bfloat16")  # what --dtype takes; engine.checkpoint maps them


@dataclass(frozen=True)
class EngineLimits:
    """What a loaded engine can take, published once and asked by everyone.

    The server turns `check` into 400s before queueing; the orchestrator calls the
    same `check` when it admits a request, so the rule cannot drift.
    """

    max_model_len: int  # prompt + completion tokens
    max_prompt_len: int  # max_model_len - 1 (chunked), else min(largest bucket, that)
    vocab_size: int  # the model's: token ids and top_k are bounded by it

    def check(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """The completion's token budget, or PromptTooLongError saying which field is over."""
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
        if max_tokens > room:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} "
                f"in the prompt, {max_tokens} in the completion). Please reduce the prompt "
                "or max_tokens.",
                prompt_tokens,
                self.max_model_len,
                param="max_tokens",
            )
        return max_tokens


class ConstraintMatcher(Protocol):
    """One sample's place in its constraint (tokenization.grammar.GrammarMatcher).

    Driven by one thread at a time: the generate stage's grammar worker.
    """

    def advance(self, token_id: int) -> bool:
        """Consume a sampled token; True when the output is complete. ValueError when the
        constraint rejects the token."""
        ...

    def fill_mask(self, out: Any) -> None:
        """The allowed next tokens into `out`, int32 words of the engine's bitmask layout."""
        ...


class TokenConstraint(Protocol):
    """A compiled structured-output constraint (tokenization.grammar.CompiledGrammar), shared
    and never changed by the samples that follow it; opaque to the engine but for these."""

    @property
    def spec(self) -> tuple[str, str]:
        """(kind, text) it was compiled from (tokenization.grammar.GrammarSpec's fields)."""
        ...

    def initial_mask(self) -> Any:
        """int32 words: the tokens allowed first (the one prefill samples)."""
        ...

    def matcher(self) -> ConstraintMatcher:
        """A fresh matcher at the start, for one sample."""
        ...


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, applied on device for each slot.

    temperature 0 is greedy. top_k 0 (or <0) and top_p 1.0 disable those
    filters. `seed` must be set by the time the engine sees it: the key of
    the i-th generated token is fold_in(PRNGKey(seed), i), i = 0 for the token
    prefill samples, so a seeded request is independent of its batch.
    `logprobs` None returns none; N in 0..20 returns the chosen token's
    logprob and the N most likely alternatives (of the raw, unscaled logits,
    as vLLM does).
    `logit_bias` ((token id, bias) pairs, ids distinct) is added to the logits
    of every sampled position; `allowed_token_ids` (None: every token) restricts
    sampling to those ids. Both shape only what is sampled: logprobs stay those
    of the model's raw logits (vLLM's default logprobs mode).
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
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    constraint: TokenConstraint | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        """Every value must be one the device arrays hold exactly (float32, int32, 64-bit key)."""
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
                raise ValueError(f"{name} must be a finite float32 number, got {value}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
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
        """SamplingError when logit_bias or allowed_token_ids names an id outside the vocabulary.

        The one owner of this rule: the server asks it for a 400, the engine before
        building the device arrays.
        """
        named = (
            ("logit_bias", [token for token, _ in self.logit_bias]),
            ("allowed_token_ids", list(self.allowed_token_ids or ())),
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
    """Host-side logprob data of one position: the chosen token and its alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Prefix:
    """A prefilled prompt, ready to be inserted into a slot.

    `token`, `logprob`, `top_ids`, `top_logprobs` describe the first generated
    token (device scalars / vectors of length MAX_LOGPROBS). `cache` and
    `last_logits` are engine-private. `prompt_logprobs` is filled only when
    prefill was asked for it (echo with logprobs): one entry per prompt
    position, the first None.
    """

    length: int
    sampling: SamplingParams
    token: Any
    logprob: Any
    top_ids: Any
    top_logprobs: Any
    cache: Any
    last_logits: Any
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class StepOutput:
    """One generate step for every slot, as device arrays (copy them off the generate thread).

    tokens, logprobs: (slots,); top_ids, top_logprobs: (slots, MAX_LOGPROBS);
    active: (slots,) bool, whether the slot was busy in this step (never past
    the step's batch). A slot's entries are meaningful only while the
    orchestrator considers it busy.
    """

    tokens: Any
    logprobs: Any
    top_ids: Any
    top_logprobs: Any
    active: Any


@dataclass(frozen=True)
class CacheStats:
    """The prefix cache as metrics see it; queries and hits count prompt tokens (vLLM's)."""

    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_blocks_used: int = 0
    prefix_blocks: int = 0  # 0: no prefix cache
    # Device memory each pool was given at start, in bytes; none of them ever grows.
    decode_cache_bytes: int = 0  # every slot's KV, a whole context each
    prefix_cache_bytes: int = 0
    prompt_buffer_bytes: int = 0  # one long prompt's KV while it is prefilled in pieces
    kv_cache_bytes: int = 0  # the engine core's KV pages (prefix cache included)


class EngineProtocol(Protocol):
    """What the orchestrator needs of an engine; a fake engine implements it too."""

    max_slots: int
    max_model_len: int
    prefill_buckets: tuple[int, ...]
    eos_token_ids: frozenset[int]

    @property
    def max_prompt_len(self) -> int:
        """max_model_len - 1 when long prompts are chunked, else min(largest bucket, that)."""
        ...

    @property
    def limits(self) -> EngineLimits:
        """The shapes a request must fit; the one owner of the length rules."""
        ...

    def init_state(self) -> Any: ...

    def cache_stats(self) -> CacheStats:
        """A snapshot of the prefix cache's counters (any thread may ask)."""
        ...

    def prefill(
        self,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        prompt_logprobs: int | None = None,
        between_chunks: Callable[[], None] | None = None,
    ) -> Prefix:
        """Pad to the next bucket, run the prompt, sample its first token (key index 0).

        A prompt longer than the largest bucket goes in chunks, with
        `between_chunks` called after each but the last. Raises
        PromptTooLongError when the prompt does not fit.
        """
        ...

    def cached_tokens(self, token_ids: Sequence[int]) -> int:
        """Prompt tokens a prefill would now find in the prefix cache (host-only, no effect)."""
        ...

    def prefill_parts(self, token_ids: Sequence[int]) -> int:
        """Device calls `prefill` would now make for this prompt: its chunks, or the pieces
        after a prefix-cache hit; 1 for a prompt that fits a bucket (host-only)."""
        ...

    def batch_fits(self, lengths: Sequence[int]) -> bool:
        """Whether prompts of these lengths can be prefilled in one `prefill_batch` call."""
        ...

    def prefill_batch(
        self, prompts: Sequence[tuple[Sequence[int], SamplingParams]]
    ) -> list[Prefix]:
        """Prefill several prompts in one call; each Prefix is the one `prefill` would give."""
        ...

    def resample(self, prefix: Prefix, sampling: SamplingParams) -> Prefix:
        """The same prompt KV with the first token sampled anew (n > 1 samples, other seeds)."""
        ...

    def insert(self, prefix: Prefix, state: Any, slot: int) -> Any:
        """Put a prefix into a slot; the state is donated."""
        ...

    def receive(self, prefix: Prefix) -> Prefix:
        """A prefix another engine prefilled (disaggregated mode), on this engine's devices."""
        ...

    def close(self) -> None:
        """No engine call follows (multi-host: the other processes are told to stop)."""
        ...

    def decode_bucket(self, busy_rows: int) -> int:
        """The smallest batch `generate` is compiled for that covers slots 0..busy_rows-1."""
        ...

    def generate(self, state: Any, batch: int | None = None) -> tuple[Any, StepOutput]:
        """One decode step for slots 0..batch-1 (a decode bucket; None: all slots); the state
        is donated, other slots are left as they are. Never blocks on the host."""
        ...

    def free(self, state: Any, slot: int) -> Any:
        """Mark a slot idle so it stops advancing."""
        ...

    def set_masks(self, state: Any, slots: Any, allowed: Any) -> Any:
        """Write allowed-token bitmasks (structured outputs) into slots' sampling rows before
        a step: `slots` (max_slots,) int32, padding max_slots (dropped); `allowed`
        (max_slots, mask words) int32. The state is donated; one shape, so one compile."""
        ...
