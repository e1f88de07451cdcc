"""What a rollout did to each replica: from which release to which, with what outcome, and how long each step took."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpufleet.rollout.release import Release, changes

ROLLED = "rolled"
ROLLED_BACK = "rolled back"
ROLLBACK_FAILED = "rollback failed"
LEFT_DRAINED = "left drained"
INTERRUPTED = "interrupted"
UNTOUCHED = "untouched"

STEPS = ("drain", "deploy", "up", "watch", "rollback", "total")
"""The timed steps, in order: drain (and wait), deploys, until UP in the routers, canary watch, the rollback."""


@dataclass
class Outcome:
    """One replica's part in the rollout."""

    replica: str
    backend: str
    before: Release | None  # what it ran when the rollout started (its release.json)
    target: Release | None  # what the rollout was to give it (None: nothing)
    state: str = UNTOUCHED
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    def took(self, step: str, seconds: float) -> None:
        self.seconds[step] = round(self.seconds.get(step, 0.0) + seconds, 1)

    def line(self) -> str:
        timed = ", ".join(f"{step} {self.seconds[step]:g} s" for step in STEPS if step in self.seconds)
        parts = [f"{self.replica}: {self.state}",
                 changes(self.before, self.target) if self.target else "no previous release recorded",
                 timed, *self.notes]
        return "; ".join(part for part in parts if part)


@dataclass
class Report:
    """Every replica's outcome, and how the rollout ended: status 0 (done), 1 (stopped by a failure, or by a
    router or a node that did not answer), 130 (interrupted)."""

    command: str
    outcomes: dict[str, Outcome]
    status: int = 0
    failure: str | None = None

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for outcome in self.outcomes.values():
            counts[outcome.state] = counts.get(outcome.state, 0) + 1
        said = ", ".join(f"{n} {state}" for state, n in counts.items())
        ending = "done" if self.status == 0 else ("interrupted" if self.status == 130 else "stopped")
        return f"gpufleet {self.command}: {ending}: {said}" + (f"; {self.failure}" if self.failure else "")

    def text(self) -> str:
        return "\n".join([*(f"  {outcome.line()}" for outcome in self.outcomes.values()), self.summary()])

    def to_json(self) -> dict[str, Any]:
        return {"command": self.command, "status": self.status, "failure": self.failure,
                "replicas": [{"replica": o.replica, "backend": o.backend, "state": o.state,
                              "from": o.before, "to": o.target, "change": changes(o.before, o.target),
                              "notes": o.notes, "seconds": o.seconds} for o in self.outcomes.values()]}
