"""What vLLM reported of each replica's KV cache at its last start, beside the plan's figure.

The readiness wait writes it on the replica's first node once the replica serves (``observed.json``:
:func:`gpufleet.node_paths.observed_file`, by ``gpufleet/node/vllm_ready.py``). Here: the line a deploy shows for
it (:func:`observed_line`, the ``vllm.kv_report`` operation), and what a valid one holds (:func:`parse_observed`;
:mod:`gpufleet.rollout.observed` reads them from the nodes for ``gpufleet plan --observed``).
"""

from __future__ import annotations

import json
from typing import Any

from gpufleet.node.vllm_ready import kv_summary

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
