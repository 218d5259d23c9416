"""Test hook: make one stage raise, to prove that a stage failure fails every open request."""

from __future__ import annotations

from dataclasses import dataclass

STAGES = ("prefill", "transfer", "generate", "detokenize")


class InjectedFault(RuntimeError):
    """Raised on purpose by OrchestratorConfig.fault_injection."""


@dataclass(frozen=True)
class FaultPlan:
    """Parsed form of "stage" or "stage:after=N": raise on the (N+1)-th unit of work."""

    stage: str
    after: int = 0

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        stage, _, option = spec.partition(":")
        if stage not in STAGES:
            raise ValueError(f"fault_injection stage must be one of {STAGES}, got {stage!r}")
        if not option:
            return cls(stage)
        key, _, value = option.partition("=")
        if key != "after" or not value.isdigit():
            raise ValueError(f"fault_injection option must be 'after=N', got {option!r}")
        return cls(stage, int(value))


class Fault:
    """Counts a stage's units of work and raises once the plan says so; inert without a plan."""

    def __init__(self, stage: str, plan: FaultPlan | None):
        self._armed = plan is not None and plan.stage == stage
        self._left = plan.after if plan is not None else 0
        self._stage = stage

    def tick(self) -> None:
        if not self._armed:
            return
        if self._left <= 0:
            raise InjectedFault(f"fault injected into the {self._stage} stage")
        self._left -= 1
