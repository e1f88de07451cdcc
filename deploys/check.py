"""Read-only: every node's GPU gate verdict and its drift from the desired state; exit 1 on either.

    pyinfra inventories/prod.py deploys/check.py

The same site sequence as deploys/vllm.py is worked out against each node's current state, and nothing
runs: every gpufleet operation that would change something records itself as drift instead. Each host's
verdict is one operation, which fails on a host whose gate fails or that drifted, listing why, so the run
exits non-zero and names it. Operations that only follow another's change (restarts, reloads, readiness
waits) are not counted; a replica restart that a deploy decided on and did not complete (its
``restart-pending`` record is on the node) is drift naming the replica, and so is a multi-node replica whose nodes
disagree on vLLM, torch, Python, Ray or the model (the line names each node's value).

A monitoring host also names each served model whose planned release has no bench record (``gpufleet bench``) while
an earlier release has one: its ceiling, alert and capacity figures still come from the release before. That line
fails nothing.
"""

import sys

from pyinfra import host

from gpufleet.operations import gates
from gpufleet.run.context import context, serve_blockers
from roles.monitoring import bench_notices
from roles.site import site

context(read_only=True)
site()
for _line in bench_notices():
    print(f"[{host.name}] bench: {_line}", file=sys.stderr)
gates.check_report(name="Gate verdict and drift", gate_failures=serve_blockers())
