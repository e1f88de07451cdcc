"""A replica's Ray cluster: wait until every node has joined."""

from __future__ import annotations

from pyinfra.api.command import StringCommand
from pyinfra.context import host

from gpufleet.facts.ray import RayActiveNodes, ray_count_command
from gpufleet.operations.node import Commands, gpufleet_operation


def wait_script(ray: str, gcs: str, nodes: int, timeout: int, token_file: str) -> str:
    """Shell that waits until ``ray status`` at ``gcs`` lists ``nodes`` active nodes, or fails after ``timeout``."""
    count = ray_count_command(ray, gcs, token_file)
    return (f"end=$(($(date +%s)+{timeout})); while :; do n=$( {count} ); [ \"$n\" -ge {nodes} ] && break;"
            f" if [ $(date +%s) -gt $end ]; then echo \"Ray at {gcs}: $n of {nodes} nodes joined"
            f" after {timeout} s\" >&2; exit 1; fi; sleep 2; done; echo \"Ray at {gcs}: $n nodes\"")


@gpufleet_operation()
def joined(ray: str, gcs: str, nodes: int, timeout: int, token_file: str, always_wait: bool = False) -> Commands:
    """
    Wait until the Ray cluster at ``gcs`` counts ``nodes`` active nodes; no change when it already does.

    + ray: the virtualenv's ``ray``
    + gcs: the head's ``address:port``
    + nodes: how many nodes must have joined
    + timeout: seconds to wait
    + token_file: the EnvironmentFile with the replica's token
    + always_wait: wait without asking first (a head just started answers nothing yet)
    """
    if not always_wait:
        found = host.get_fact(RayActiveNodes, ray=ray, gcs=gcs, token_file=token_file)
        if found >= nodes:
            host.noop(f"Ray at {gcs} counts {found} of {nodes} nodes")
            return
    yield StringCommand(wait_script(ray, gcs, nodes, timeout, token_file))
