"""gpufleet's pyinfra operations, one home for all of them.

Each operation compares what it wants with what the node reports and yields only the commands that close
the gap; with nothing to do it says why (``host.noop``). Roles read the node's state in at most one command per
role (:func:`~gpufleet.operations.node.observe`; the first reading takes in every role's items, and while nothing
has run on the node the later roles read nothing) and every operation after it answers from that reading, so a
run that changes nothing costs a handful of commands per host. Modules: ``node`` (the reading, read-only mode and
drift), ``files``, ``systemd``, ``apt``, ``server`` (accounts, scripts, reboot), ``gates``, ``nvidia``, ``ray``.
Tests as data: ``tests/data/operations/<module>.<operation>/*.json``.
"""
