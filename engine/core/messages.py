"""What crosses between the HTTP process and the engine core's process, and nothing else.

Owns: the message types (msgspec Structs, tagged so one decoder reads any of them) and
their codec. The HTTP side (frontend/) sends `AddRequest` and `Abort`; the core sends
`Ready` once, then `Outputs` after each step (and `Log` records, and `Failed` once if it
dies). Each sampled token crosses as a `TokenOut` carrying the core's verdict on it.

Token ids in, token ids out: text never crosses. Why msgspec over pickle: typed decoding
checks every field on arrival (a malformed message is an error, not an object of any
class), it is several times faster on these small messages, and it carries no code.
"""

from __future__ import annotations

import msgspec

from engine.types import SamplingParams


class Sample(msgspec.Struct, frozen=True):
    """One of a request's n samples: its sampling (seeded), as engine.types has it."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    logit_bias: tuple[tuple[int, float], ...]
    allowed_token_ids: tuple[int, ...] | None
    logprob_token_ids: tuple[int, ...] | None = None

    @classmethod
    def of(cls, sampling: SamplingParams) -> Sample:
        if sampling.seed is None:
            raise ValueError("a sample crosses to the core with its seed set")
        return cls(
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            seed=sampling.seed,
            logprobs=sampling.logprobs,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty,
            repetition_penalty=sampling.repetition_penalty,
            min_tokens=sampling.min_tokens,
            logit_bias=sampling.logit_bias,
            allowed_token_ids=sampling.allowed_token_ids,
            logprob_token_ids=sampling.logprob_token_ids,
        )

    def params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            logprobs=self.logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            logit_bias=tuple((int(t), float(b)) for t, b in self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            logprob_token_ids=self.logprob_token_ids,
        )


class Grammar(msgspec.Struct, frozen=True):
    """A structured-output constraint as tokenization.grammar.GrammarSpec has it."""

    kind: str
    text: str


class AddRequest(msgspec.Struct, frozen=True, tag=True):
    """A request of n samples; the core decides every token rule of it (EOS, stop ids after
    min_tokens, the budget, grammar completion) and checks its length and ids."""

    request_id: str
    prompt: tuple[int, ...]
    samples: tuple[Sample, ...]
    max_tokens: int | None  # None: until the context is full
    stop_token_ids: tuple[int, ...]  # the request's own (the core adds its EOS set)
    prompt_logprobs: int | None = None
    grammar: Grammar | None = None
    ignore_eos: bool = False
    lora: str = ""  # the LoRA adapter's name ("": the base model)


class Abort(msgspec.Struct, frozen=True, tag=True):
    """End these samples (request id, sample index) wherever they are."""

    samples: tuple[tuple[str, int], ...]


class LoadLora(msgspec.Struct, frozen=True, tag=True):
    """Read a LoRA adapter's folder (on the core's host) and serve it as `name`."""

    name: str
    path: str


class UnloadLora(msgspec.Struct, frozen=True, tag=True):
    """No new request may name the adapter; those running with it finish."""

    name: str


class Stop(msgspec.Struct, frozen=True, tag=True):
    """The core finishes its step and exits cleanly."""


class TokenOut(msgspec.Struct, frozen=True, array_like=True):
    """One sampled token of one sample; `finish` set on its last (then no more come): the
    core's verdict, the one token event that crosses the boundary."""

    request_id: str
    index: int
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    finish: str | None = None  # "stop" | "length"
    done: bool = False  # its grammar is complete (finish "stop", the token's text is kept)
    error: str | None = None  # the sample failed (its constraint refused): a 400
    cached_tokens: int = 0  # first token only
    prompt_logprobs: tuple[tuple[int, float, tuple[tuple[int, float], ...]] | None, ...] | None = (
        None
    )
    scheduled: float = 0.0  # first token only: when its first step began (core's clock)
    stop_reason: int | None = None  # the stop token id that ended it (None: EOS or other)


class Stats(msgspec.Struct, frozen=True):
    """Gauges and counters of the core, sent with every step's outputs."""

    waiting: int
    running: int
    pages_total: int
    pages_free: int
    pages_cached: int  # evictable pages holding a registered prefix block
    steps: int
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    spec_drafts: int = 0  # speculation (engine.core.speculation.SpecCounters)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    lora_running: tuple[str, ...] = ()  # adapters of running sequences (engine.lora)
    lora_waiting: tuple[str, ...] = ()  # adapters of waiting ones
    max_loras: int = 0


class Outputs(msgspec.Struct, frozen=True, tag=True):
    tokens: tuple[TokenOut, ...]
    stats: Stats
    rejected: tuple[tuple[str, str], ...] = ()  # (request id, why): never admitted


class Ready(msgspec.Struct, frozen=True, tag=True):
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    kv_cache_bytes: int
    num_pages: int
    page_size: int
    weight_bytes: int = 0  # the params' (after quantization)


class LoraDone(msgspec.Struct, frozen=True, tag=True):
    """The answer to LoadLora (`loaded`) or UnloadLora: `error` says why it failed."""

    name: str
    loaded: bool
    error: str | None = None


class Failed(msgspec.Struct, frozen=True, tag=True):
    error: str


class Log(msgspec.Struct, frozen=True, tag=True):
    level: int
    name: str
    message: str
    traceback: str | None = None


ToCore = AddRequest | Abort | Stop | LoadLora | UnloadLora
FromCore = Ready | Outputs | Failed | Log | LoraDone

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


def encode(message: ToCore | FromCore) -> bytes:
    return _encoder.encode(message)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def decode_from_core(data: bytes) -> FromCore:
    return _from_core.decode(data)
