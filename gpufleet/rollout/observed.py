"""Each replica's ``observed.json`` (what vLLM reported of its KV cache at its last start), read from its first
node for ``gpufleet plan --observed``, over the connections ``gpufleet upgrade`` makes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpufleet.node_paths import observed_file
from gpufleet.plan.kv_observed import parse_observed
from gpufleet.plan.planner import Replica
from gpufleet.remote.commands import Remote
from gpufleet.rollout.node_releases import RecordFailure, read_texts

MAX_BYTES = 16384  # an observed.json is a few hundred bytes


def read_observed(remote: Remote, replicas: Sequence[Replica]) -> tuple[dict[str, dict[str, Any] | None], list[str]]:
    """Each replica's observed.json from its first node, by replica (None: none there, or unreadable), and one line
    per node or file that could not be read; one command per node."""
    by_node: dict[str, list[str]] = {}
    for replica in replicas:
        by_node.setdefault(replica.nodes[0], []).append(replica.name)
    found: dict[str, dict[str, Any] | None] = {replica.name: None for replica in replicas}
    problems: list[str] = []
    for node, names in by_node.items():
        try:
            texts = read_texts(remote, node, [observed_file(name) for name in names], "the KV cache vLLM reported",
                               MAX_BYTES)
        except RecordFailure as exc:
            problems.append(str(exc))
            continue
        for name in names:
            text = texts.get(observed_file(name))
            try:
                found[name] = None if text is None else parse_observed(text)
            except ValueError as exc:
                problems.append(f"node {node}: {observed_file(name)}: {exc}")
    return found, problems
