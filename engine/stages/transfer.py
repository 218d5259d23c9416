"""The transfer stage (disaggregated mode): prefilled prompts moved to the generate devices.

Runs on: the transfer thread. Owns: nothing but its calls into the generate
engine's `receive`, which copies a Prefix (its KV and first token) from the
prefill engine's devices onto the generate engine's, in the layout that
engine's own prefill gives. Receives: PrefillDone (its inbox, the prefill
stage's sink). Emits: the same PrefillDone, now holding the moved Prefix, into
the generate inbox.

Order by construction: a sample's first token rides inside its PrefillDone
from prefill through here to the generate stage, which puts it on the one
detokenize queue ahead of every later token (engine/stages/messages.py); no
token takes another path. The prefill stage's credits stay held until the
generate stage takes the sample, so the prefixes in flight here are bounded
by them; a cancelled job's prefix is dropped here and its credit returned.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

from engine.stages.faults import Fault
from engine.stages.messages import GenerateMessage, PrefillDone
from engine.stages.queues import Credits, get, put
from engine.types import EngineProtocol


class TransferStage:
    def __init__(
        self,
        engine: EngineProtocol,
        outbox: queue.Queue[GenerateMessage],
        credits: Credits,
        stop: threading.Event,
        fault: Fault,
    ):
        self._engine = engine  # the generate engine
        self.inbox: queue.Queue[PrefillDone] = queue.Queue(credits.limit)
        self._outbox = outbox
        self._credits = credits
        self._stop = stop
        self._fault = fault
        self.transfers = 0  # counter: written here only

    def put(self, item: PrefillDone) -> None:
        """The prefill stage's sink: never blocks for long, credits bound what is here."""
        put(self.inbox, item, self._stop)

    @property
    def depth(self) -> int:
        """Prefilled samples waiting to be moved (the queue-depth gauge)."""
        return self.inbox.qsize()

    def run(self) -> None:
        while not self._stop.is_set():
            done = get(self.inbox, self._stop)
            if done is None:
                return
            if done.job.cancelled.is_set():
                self._credits.release()
                continue
            self._fault.tick()
            timings = done.job.stream.timings
            if timings.transfer_start is None:
                timings.transfer_start = time.monotonic()
            moved = self._engine.receive(done.prefix)
            if timings.transfer_end is None:
                timings.transfer_end = time.monotonic()
            self.transfers += 1
            put(self._outbox, dataclasses.replace(done, prefix=moved), self._stop)
