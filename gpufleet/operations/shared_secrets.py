"""Secrets that several nodes must hold alike and that no one supplies: drawn once on the controller, in the run
that finds the nodes without one or disagreeing, and written on all of them (a multi-node replica's rank secret,
the routers' peer certificate and key). Each node's file is read first (:func:`seen`) on every node, then kept or
replaced (:func:`kept`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from pyinfra.context import host, state

from gpufleet.operations import files, node
from gpufleet.operations.node import Commands, fail, gpufleet_operation

_EMPTY = hashlib.sha256(b"").hexdigest()  # a secret file left empty by an interrupted write holds no secret


@gpufleet_operation(counts_as_drift=False, runs_when_read_only=True)
def seen(path: str, found: dict[str, str | None], what: str) -> Commands:
    """
    Record the digest of this node's secret file in ``found`` under the host's name (None: no file, or an empty
    one), for :func:`kept`; changes nothing.

    + path: the secret's file
    + found: the secret's record, node -> digest
    + what: the secret, as the log names it
    """
    if not state.is_executing:  # pyinfra's look ahead when ops are added
        host.noop("read when the run gets here")
        return
    stat = node.path(path)
    digest = stat.get("sha256") if stat["type"] == "file" else None
    found[host.name] = None if digest in (None, _EMPTY) else digest
    host.noop(f"{what}: {'there' if found[host.name] else 'none yet'}")
    yield from ()


@gpufleet_operation()
def kept(what: str, path: str, holders: list[str], found: dict[str, str | None], draw: Callable[[], str],
         chosen: dict[str, str], group: str = "root", mode: str = "0600") -> Commands:
    """
    Keep the secret ``what`` that ``holders`` share: the one they hold when all of them in this run (:func:`seen`)
    hold the same; else a new one, drawn once on the controller (``draw``) and written on each of them (root and
    ``group``, ``mode``; never shown). A new one is due only with every holder in the run: else this node fails,
    rather than disagree with the others.

    + what: the secret, as messages name it ("the rank secret of replica r0")
    + path: its file
    + holders: the nodes that share it
    + found: what :func:`seen` recorded on each
    + draw: makes a new one (its text)
    + chosen: ``what`` -> the secret drawn in this run (shared by the holders' operations)
    + group: the file's group (a service account that reads it)
    + mode: the file's mode
    """
    if not state.is_executing:  # pyinfra's look ahead when ops are added: nothing is recorded yet
        host.noop(f"decided when the run gets here, once {', '.join(holders)} have been read")
        return
    digests = {found[name] for name in holders if name in found}
    if len(digests) == 1 and None not in digests:
        yield from files.owner_and_mode(path, "root", group, mode, f"{path} holds {what}")
        return
    if missing := [name for name in holders if name not in found]:
        yield fail(f"{what}: {', '.join(holders)} need a new one, written on all of them in one run:"
                   f" deploy {', '.join(missing)} too")
        return
    if what not in chosen:
        chosen[what] = draw()
    yield from files.secret_commands(path, chosen[what], mode=mode, group=group)
