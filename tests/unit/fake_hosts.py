"""A pyinfra host and state for running one of gpufleet's operations or facts in this process, without a node."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from gpufleet.facts.node import empty_node_state


class FakeHost:
    """A host that answers facts from the case (``facts``, by fact class name) and records why nothing changed."""

    name = "10.0.0.5"

    def __init__(self, facts: dict[str, Any]) -> None:
        self.facts = facts
        self.noops: list[str] = []
        self.logged: list[list[str]] = []
        self.current_op_hash = "op"

    def get_fact(self, fact: type, *args: Any, **kwargs: Any) -> Any:
        found = self.facts.get(fact.__name__)
        if isinstance(found, dict) and set(found) == {"$answers"}:  # one answer per call, the last one repeats
            answers = found["$answers"]
            found = answers.pop(0) if len(answers) > 1 else answers[0]
        if fact.__name__ == "NodeState":
            whole = empty_node_state()
            for kind, items in (found or {}).items():
                whole[kind].update(items)  # type: ignore[literal-required]
            return whole
        return found

    def noop(self, text: str) -> None:
        self.noops.append(text)

    def log(self, message: str, log_func: Callable[[str], Any]) -> None:
        self.logged.append([log_func.__name__, message])

    def get_temp_filename(self, key: str) -> str:
        return "/tmp/pyinfra-" + re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "UUID", key)

    def _get_module(self) -> FakeHost:
        return self


class FakeState:
    """pyinfra's state while it executes operations: what an operation asks of it, and no more."""

    is_executing = True

    def get_op_meta(self, op_hash: str) -> Any:
        return type("Meta", (), {"names": {"the operation"}})()

    def _get_module(self) -> FakeState:
        return self
