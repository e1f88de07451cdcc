"""Verdicts that stop a host: the GPU health gate before serving, and check's report of gate and drift."""

from __future__ import annotations

import sys
from collections.abc import Callable

from pyinfra.context import host

from gpufleet.operations.node import Commands, drift, fail, gpufleet_operation
from gpufleet.pyinfra_seam import current_host


@gpufleet_operation(counts_as_drift=False)
def gpu_gate(verdict: Callable[[], list[str]]) -> Commands:
    """
    Fail this host when its GPUs fail its ``gpu_health`` policy, could not be probed, or the plan cannot serve
    its pool on the probed hardware; no change otherwise.

    + verdict: why the host must not serve, one reason each (empty: it passes), asked when the gate runs
    """
    failures = verdict()
    if failures:
        yield fail("GPU health gate failed: " + "; ".join(failures))
        return
    host.noop("the GPUs pass the health gate")


@gpufleet_operation(counts_as_drift=False, runs_when_read_only=True)
def check_report(gate_failures: list[str]) -> Commands:
    """
    Print this host's verdict and fail it with its gate failures and its drift (the operations before this one
    that would have changed something, read-only mode), one per line; no change when there is none.

    + gate_failures: why the host must not serve (empty: it passes its gate)
    """
    found = drift(current_host())
    print(f"[{host.name}] gate: {'fail' if gate_failures else 'pass'}; drift: {len(found)} operation(s)",
          file=sys.stderr)
    failures = [f"gate: {line}" for line in gate_failures] + [f"drift: {name}" for name in found]
    if failures:
        yield fail("\n".join(failures))
        return
    host.noop("gate passed, no drift")
