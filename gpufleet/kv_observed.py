"""What vLLM reported of each replica's KV cache at its last start, beside the plan's figure.

The readiness wait writes it on the replica's first node once the replica serves (``observed.json``:
:func:`gpufleet.node_paths.observed_file`, by ``gpufleet/node/vllm_ready.py``). Here: the line a deploy shows for
it (:func:`observed_line`, the ``vllm.kv_report`` operation), and reading it from the nodes for ``gpufleet plan
--observed`` (:func:`read_observed`), over the connections ``gpufleet upgrade`` makes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gpufleet.node.vllm_ready import kv_summary
from gpufleet.node_paths import observed_file
from gpufleet.plan.planner import Replica
from gpufleet.rollout.node_releases import RecordFailure, read_texts
from gpufleet.rollout.remote import Remote

MAX_BYTES = 16384  # an observed.json is a few hundred bytes
NOT_YET = "vLLM's figure is not recorded yet (observed.json is written when the replica starts)"


def parse_observed(text: str) -> dict[str, Any]:
    """An observed.json; ValueError, saying what is wrong, when it is not what the readiness wait writes."""
    try:
        doc = json.loads(text)
    except ValueError:
        raise ValueError(f"observed.json is not JSON: {text[:80]!r}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"observed.json is not a JSON object: {text[:80]!r}")
    tokens = doc.get("kv_cache_tokens")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
        raise ValueError(f"observed.json holds kv_cache_tokens {tokens!r}")
    return doc


def observed_line(planned: int, text: str | None, tolerance: float) -> tuple[bool, str]:
    """(whether vLLM's KV cache differs from the plan's by more than ``tolerance``, or cannot be read; one line)
    from the text of a replica's observed.json (None: there is none)."""
    if text is None:
        return False, f"KV cache planned {planned:,} tokens; {NOT_YET}"
    try:
        doc = parse_observed(text)
    except ValueError as exc:
        return True, f"KV cache planned {planned:,} tokens; {exc}"
    _, off, line = kv_summary(planned, doc.get("kv_cache_tokens"), tolerance)
    return off, line


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
