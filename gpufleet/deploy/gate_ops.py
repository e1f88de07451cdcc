"""The GPU health gate as a pyinfra operation: no change on a healthy node, a failure on any other.

A failing operation makes pyinfra stop every later operation on that host (so it never serves) and
name it in the run's report; the verdict comes from the facts probed once for the deploy.
"""

from __future__ import annotations

import shlex

from pyinfra.api import StringCommand, operation

from gpufleet.deploy.context import serve_blockers


@operation(is_idempotent=True)
def gpu_gate():
    """
    Fail this host when its GPUs fail its ``gpu_health`` policy, could not be probed, or the plan
    cannot serve its pool on the probed hardware.
    """
    failures = serve_blockers()
    if failures:
        message = "GPU health gate failed: " + "; ".join(failures)
        yield StringCommand(f"echo {shlex.quote(message)} >&2; exit 1")
