"""Read-only: every node's GPU gate verdict and its drift from the desired state; exit 1 on either.

    pyinfra inventories/prod.py deploys/check.py

The same operations as deploys/vllm.py are worked out against each node's current state, and none
runs: an operation that would change something is drift. Each host's verdict is one operation, which
fails on a host whose gate fails or that drifted, listing why, so the run exits non-zero and names it.
Operations that only follow another's change (restarts, reloads, readiness waits) are not counted; a
replica restart that a deploy decided on and did not complete (its ``restart-pending`` record is on the
node) is drift naming the replica.
"""

import sys

from pyinfra import host, state

from gpufleet.deploy.context import context, serve_blockers
from gpufleet.deploy.drift import check_report, drift_of, take_operations
from roles.common import common
from roles.dcgm import dcgm
from roles.dcgm_exporter import dcgm_exporter
from roles.node_exporter import node_exporter
from roles.nvidia_driver import nvidia_driver
from roles.ray import ray
from roles.vllm import pending_restarts, vllm_install, vllm_serve

context()
common()
nvidia_driver()
dcgm()
node_exporter()
dcgm_exporter()
vllm_install()
ray()
vllm_serve()

verdict = serve_blockers()
drift = drift_of(state, host) + [f"vLLM: replica {name} must still restart (restart-pending)"
                                 for name in pending_restarts()]
take_operations(state, host)  # nothing above runs: this deploy only reads
failures = [f"gate: {line}" for line in verdict] + [f"drift: {name}" for name in drift]
print(f"[{host.name}] gate: {'fail' if verdict else 'pass'}; drift: {len(drift)} operation(s)", file=sys.stderr)
check_report(name="Gate verdict and drift", failures=failures)
