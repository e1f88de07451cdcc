"""The release records on a replica's nodes (:mod:`gpufleet.rollout.release`): read them, and keep the release a
change is about to replace as ``release.previous.json``.

Both run over :mod:`gpufleet.remote.commands` as the host's data says (root: ``_sudo`` where the SSH user is not):
one ``head`` for every record of a node (:func:`read_texts`, also ``gpufleet plan --observed``'s reader); ``cp``
before a change, and ``mv`` once it held (or ``rm`` when it was rolled back), so ``release.previous.json`` is
replaced whole, and only by a change that held.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from gpufleet.node_paths import previous_release_file, release_file
from gpufleet.remote.commands import Remote
from gpufleet.rollout.release import MAX_BYTES, Release, ReleaseError, parse_release

TIMEOUT_S = 60.0
_HEADER = re.compile(r"==> (.+) <==")  # what head -v prints before each file
_MISSING = "No such file or directory"


class RecordFailure(Exception):
    """A node whose release records could not be read or kept: one line."""


@dataclass(frozen=True)
class NodeRecords:
    """One replica's records on one node: what it runs, and what it ran before the last change (None: none)."""

    current: Release | None
    previous: Release | None


def _texts(stdout: str, paths: Sequence[str]) -> dict[str, str]:
    """Each file's text from ``head -v``'s output, by path."""
    texts: dict[str, list[str]] = {}
    lines: list[str] | None = None
    for line in stdout.splitlines():
        header = _HEADER.fullmatch(line)
        if header and header[1] in paths:
            lines = texts.setdefault(header[1], [])
        elif lines is not None:
            lines.append(line)
    return {path: "\n".join(found).strip() for path, found in texts.items()}


def read_texts(remote: Remote, node: str, paths: Sequence[str], what: str,
               max_bytes: int = MAX_BYTES) -> dict[str, str]:
    """The text of each of ``paths`` on ``node`` that is there (its first ``max_bytes``), by path, in one command;
    RecordFailure, naming ``what`` they are, when the node cannot say."""
    result = remote.run(node, ["env", "LC_ALL=C", "head", "-v", "-c", str(max_bytes), "--", *paths],
                        timeout_s=TIMEOUT_S, ok_status=(0, 1))
    if not result.ok:
        raise RecordFailure(f"node {node}: cannot read {what}: {result.line()}")
    texts = _texts(result.stdout, paths)
    for path in paths:
        if path in texts:
            continue
        said = [line for line in result.stderr.splitlines() if path in line]
        if not said or not said[0].rstrip().endswith(_MISSING):
            raise RecordFailure(f"node {node}: cannot read {path}: {said[0] if said else 'no output'}")
    return texts


def read_records(remote: Remote, node: str, replicas: Sequence[str]) -> dict[str, NodeRecords]:
    """The records of ``replicas`` on ``node``, by replica; RecordFailure when the node cannot say."""
    paths = [path for replica in replicas for path in (release_file(replica), previous_release_file(replica))]
    texts = read_texts(remote, node, paths, "the release records")

    def parsed(path: str) -> Release | None:
        return parse_release(texts[path], f"{node}:{path}") if path in texts else None

    try:
        return {replica: NodeRecords(parsed(release_file(replica)), parsed(previous_release_file(replica)))
                for replica in replicas}
    except ReleaseError as exc:
        raise RecordFailure(str(exc)) from None


def _staged(replica: str) -> str:
    return f"{previous_release_file(replica)}.gpufleet-new"


def _run(remote: Remote, node: str, replica: str, words: list[str]) -> None:
    result = remote.run(node, words, timeout_s=TIMEOUT_S)
    if not result.ok:
        raise RecordFailure(f"node {node}: cannot keep the release {replica} ran: {result.line()}")


def stage_previous(remote: Remote, node: str, replica: str) -> None:
    """Copy the replica's ``release.json`` on ``node`` beside its ``release.previous.json``, before a change: it
    becomes the previous release only once the change holds (:func:`keep_previous`)."""
    _run(remote, node, replica, ["cp", "-f", "--", release_file(replica), _staged(replica)])


def keep_previous(remote: Remote, node: str, replica: str) -> None:
    """The change held: the staged copy replaces ``release.previous.json`` (whole or not at all)."""
    _run(remote, node, replica, ["mv", "-fT", "--", _staged(replica), previous_release_file(replica)])


def drop_staged(remote: Remote, node: str, replica: str) -> None:
    """The change was rolled back: ``release.previous.json`` stays what it was, and the staged copy goes."""
    _run(remote, node, replica, ["rm", "-f", "--", _staged(replica)])
