"""Disaggregated serving: a prefill set and a decode set of devices, one loop over both.

Runs on: the core loop's thread (engine.core.loop drives it as it drives one EngineCore).
Owns: two EngineCores, each with its own scheduler, pages and runner on its own devices.
Receives sequences (`add`, `abort`); emits both cores' `Emitted` tokens, a sequence's
first one from the prefill set, the rest from the decode set, all through the one loop
and socket, so a sample's tokens stay in order (the JetStream lesson in the design note).

Each step launches the prefill set's step and the decode set's step back to back (JAX
dispatches both before either is waited for, so the two device sets run at once), then
takes their tokens. The prefill set's scheduler computes prompts only
(`SchedulerConfig.prefill_only`): a sequence whose first token is sampled leaves it with
its pages. Once the decode set has a row and pages for it, those pages are copied across
(per layer: gather, `device_put` from one mesh to the other, scatter; prompt blocks the
decode set's prefix cache already holds are shared instead), registered in its prefix
cache, and the sequence runs there from its first token on, with its tokens, sampling
state and grammar: its next step is the decode row it would have had on one set, so its
tokens and logprobs are bit for bit those. Until then it waits, in order, its pages held
in the prefill set (which slows the prefill set, never the decode set).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, replace

import jax

from engine.config import ModelConfig
from engine.core.config import CoreConfig
from engine.core.core import EngineCore, Pending
from engine.core.messages import Stats
from engine.core.runner import pages_sharding
from engine.core.sequence import Emitted, SequenceState
from engine.mesh import device_sets
from engine.types import EngineLimits

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PendingPair:
    """One loop step: the prefill set's step and the decode set's, either may be None."""

    prefill: Pending | None
    decode: Pending | None


@dataclass
class TransferCounters:
    sequences: int = 0  # handed from the prefill set to the decode set
    pages: int = 0  # copied across (the rest were cached there already)
    waits: int = 0  # steps after which one still waited for a row or pages there


class DisaggregatedCore:
    def __init__(self, prefill: EngineCore, decode: EngineCore) -> None:
        if prefill.scheduler.pool.page_size != decode.scheduler.pool.page_size:
            raise ValueError("the prefill and decode sets need the same page size")
        source, target = prefill.runner.layout, decode.runner.layout
        if (source.page_shape, source.dtype) != (target.page_shape, target.dtype):
            raise ValueError(
                f"the prefill and decode sets lay out pages differently ({source.page_shape} "
                f"against {target.page_shape}): give both the same number of devices"
            )
        self.prefill = prefill
        self.decode = decode
        self.transfers = TransferCounters()
        # prompts computed, first token sampled, waiting for a decode row (their pages
        # held in the prefill set meanwhile)
        self._handoffs: deque[SequenceState] = deque()
        self._target = pages_sharding(decode.mesh, target)

    @classmethod
    def build(
        cls, config: CoreConfig, prefill_devices: str, generate_devices: str
    ) -> DisaggregatedCore:
        """Two cores of `config` on the device sets these specs name (engine.mesh), each a
        tensor-parallel mesh of its devices."""
        if config.speculative_config is not None:
            raise ValueError("speculative decoding is not supported with disaggregated serving")
        available = [d.id for d in jax.devices()]
        ids = device_sets(prefill_devices, generate_devices, available)
        for name, chosen in zip(("prefill_devices", "generate_devices"), ids, strict=True):
            if config.tensor_parallel_size not in (1, len(chosen)):
                raise ValueError(
                    f"{name} {list(chosen)}: tensor_parallel_size {config.tensor_parallel_size}"
                    " must be 1 or the set's size (each set is a mesh of its own devices)"
                )
        prefill = EngineCore(
            replace(config, devices=ids[0], tensor_parallel_size=len(ids[0]), prefill_only=True)
        )
        decode = EngineCore(replace(config, devices=ids[1], tensor_parallel_size=len(ids[1])))
        logger.info("disaggregated: prefill on devices %s, decode on %s", ids[0], ids[1])
        return cls(prefill, decode)

    # -- what the loop and the process read ---------------------------------------------
    @property
    def config(self) -> CoreConfig:
        return self.decode.config

    @property
    def model_config(self) -> ModelConfig:
        return self.decode.model_config

    @property
    def page_size(self) -> int:
        return self.decode.page_size

    @property
    def limits(self) -> EngineLimits:
        return self.decode.limits

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.decode.eos_token_ids

    @property
    def kv_cache_bytes(self) -> int:
        return self.prefill.kv_cache_bytes + self.decode.kv_cache_bytes

    @property
    def weight_bytes(self) -> int:
        return self.prefill.weight_bytes + self.decode.weight_bytes

    @property
    def num_pages(self) -> int:
        return self.prefill.scheduler.pool.num_pages + self.decode.scheduler.pool.num_pages

    @property
    def adapters(self) -> None:
        """LoRA adapters are not served disaggregated (server.config refuses the pair)."""
        return None

    @property
    def handing_over(self) -> tuple[str, ...]:
        """The sequences computed on the prefill set that wait for a decode row, in order."""
        return tuple(seq.seq_id for seq in self._handoffs)

    @property
    def busy(self) -> bool:
        return self.prefill.busy or self.decode.busy or bool(self._handoffs)

    def stats(self, steps: int) -> Stats:
        """Both sets' gauges added up; the prefix cache's counters are the prefill set's
        (the decode set's hits are the copied prompts)."""
        p, d = self.prefill.stats(steps), self.decode.stats(steps)
        return Stats(
            waiting=p.waiting + d.waiting + len(self._handoffs),
            running=p.running + d.running,
            pages_total=p.pages_total + d.pages_total,
            pages_free=p.pages_free + d.pages_free,
            pages_cached=p.pages_cached + d.pages_cached,
            steps=steps,
            prefix_queries=p.prefix_queries,
            prefix_hits=p.prefix_hits,
            preemptions=p.preemptions + d.preemptions,
        )

    # -- requests and steps -------------------------------------------------------------
    def warmup(self) -> None:
        self.prefill.warmup()
        self.decode.warmup()
        self._copy([], [])  # compiles the copy's programs (padding only)

    def add(self, seq: SequenceState) -> None:
        self.prefill.add(seq)

    def abort(self, seq_id: str) -> bool:
        for seq in self._handoffs:
            if seq.seq_id == seq_id:
                self._handoffs.remove(seq)
                self.prefill.scheduler.pool.free(seq.pages)
                return True
        return self.prefill.abort(seq_id) or self.decode.abort(seq_id)

    def launch(self, ahead: bool = False) -> PendingPair | None:
        """Both sets' next steps, dispatched; each is planned ahead of its own step in
        flight when it has one (`ahead` is the loop's, for the pair)."""
        self._admit_handoffs()  # rows or pages may have freed since (an abort)
        prefill = self.prefill.launch(ahead=self.prefill.scheduler.in_flight > 0)
        decode = self.decode.launch(ahead=self.decode.scheduler.in_flight > 0)
        if prefill is None and decode is None:
            return None
        return PendingPair(prefill, decode)

    def finish(self, pending: PendingPair) -> list[Emitted]:
        """The pair's tokens (the prefill set's first), then the prefill set's finished
        prompts handed to the decode set, in order, as far as it has rows and pages."""
        events = [] if pending.prefill is None else self.prefill.finish(pending.prefill)
        self._handoffs += self.prefill.scheduler.take_handoffs()
        if pending.decode is not None:
            events += self.decode.finish(pending.decode)
        if not self._admit_handoffs():
            self.transfers.waits += 1
        return events

    def _admit_handoffs(self) -> bool:
        """Hand over the waiting sequences in order; False when one is still waiting."""
        while self._handoffs:
            if not self._hand_over(self._handoffs[0]):
                return False
            self._handoffs.popleft()
        return True

    def _hand_over(self, seq: SequenceState) -> bool:
        """Copy seq's pages into the decode set (prompt blocks it has cached are shared,
        not copied), free them in the prefill set, and run it there; False (nothing
        changes) while the decode set has no row or pages for it."""
        decode = self.decode.scheduler
        if not decode.can_adopt:
            return False
        pool = decode.pool
        have = pool.match_prefix(seq.prompt)
        new = pool.allocate(len(seq.pages) - len(have))
        if new is None:
            pool.free(have)
            return False
        self._copy(seq.pages[len(have) :], new)
        held = have + new
        pool.register(held, seq.tokens, len(seq.prompt))
        self.prefill.scheduler.pool.free(seq.pages)
        adopted = decode.adopt(seq, held)
        assert adopted
        self.transfers.sequences += 1
        self.transfers.pages += len(new)
        return True

    def _copy(self, source: list[int], target: list[int]) -> None:
        blocks = jax.device_put(self.prefill.runner.read_pages(source), self._target)
        self.decode.runner.write_pages(target, blocks)


__all__ = ["DisaggregatedCore", "PendingPair"]
