"""vLLM replicas: the restart record that makes an interrupted restart happen on the next run."""

from __future__ import annotations

from collections.abc import Callable

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.context import host

from gpufleet.operations import node
from gpufleet.operations.node import Commands, gpufleet_operation


@gpufleet_operation()
def restart_record(marker: str, changed: Callable[[], bool], pending: Callable[[], None]) -> Commands:
    """
    Record on the node that its replica must restart: when its files changed in this run (``changed``), or
    when a record left by an interrupted run is still there (then ``pending`` is told, and check reports it).

    + marker: the replica's ``restart-pending`` file
    + changed: whether any of the replica's files changed, on any of its nodes
    + pending: called when the record was already there
    """
    if node.path(marker)["type"] != "missing":
        pending()
        yield StringCommand("touch", QuoteString(marker))  # still due: a restart an earlier run did not finish
        return
    if not changed():
        host.noop("no restart due")
        return
    node.forget("paths", marker)
    yield StringCommand("touch", QuoteString(marker))
