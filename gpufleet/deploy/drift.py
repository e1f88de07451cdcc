"""Drift: the operations a deploy would change on a host, worked out without running any of them."""

from __future__ import annotations

import shlex
from typing import Any

from pyinfra.api import StringCommand, operation


def drift_of(state: Any, host: Any) -> list[str]:
    """Names of this host's operations that would change something, in deploy order.

    Operations guarded by ``_if`` only follow another's change (a restart, a reload, a readiness wait):
    they are not drift of their own.
    """
    found = []
    for op_hash in state.get_op_order():
        data = state.ops[host].get(op_hash)
        if data is None or data.global_arguments.get("_if"):
            continue
        for _ in data.command_generator():
            found.append(", ".join(sorted(state.get_op_meta(op_hash).names)))
            break
    return found


def take_operations(state: Any, host: Any) -> None:
    """Drop every operation defined so far for ``host``: it only reads."""
    state.ops[host] = {}


@operation(is_idempotent=True)
def check_report(failures: list[str]):
    """
    Fail this host with its gate failures and drift, one per line; no change when there is none.
    """
    if failures:
        text = "\n".join(failures)
        yield StringCommand(f"printf '%s\\n' {shlex.quote(text)} >&2; exit 1")
