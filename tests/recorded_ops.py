"""Role tests without a node: every operation a role adds is recorded (module, name, arguments) instead of run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RecordedOp:
    """A recorded operation: its module and name, its arguments, and whether it changed the node."""

    op: str
    kwargs: dict[str, Any]
    changed: bool = False
    done: bool = True

    def is_complete(self) -> bool:
        return self.done

    def did_change(self) -> bool:
        return self.changed


@dataclass
class Recorder:
    calls: list[RecordedOp] = field(default_factory=list)

    def module(self, name: str) -> Any:
        """A stand-in for operations module ``name``: each of its operations records its call."""
        recorder = self

        class Module:
            def __getattr__(self, op: str) -> Callable[..., RecordedOp]:
                def call(*args: Any, **kwargs: Any) -> RecordedOp:
                    recorder.calls.append(RecordedOp(f"{name}.{op}", kwargs))
                    return recorder.calls[-1]
                return call
        return Module()

    def named(self, op: str, **match: Any) -> list[RecordedOp]:
        """The recorded calls of ``op`` (``module.operation``) whose arguments include ``match``."""
        return [c for c in self.calls if c.op == op and all(c.kwargs.get(k) == v for k, v in match.items())]
