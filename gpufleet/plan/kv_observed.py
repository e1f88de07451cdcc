"""What vLLM reported of each replica's KV cache at its last start, beside the plan's figure.

The readiness wait writes it on the replica's first node once the replica serves (``observed.json``:
:func:`gpufleet.node_paths.observed_file`, by ``gpufleet/node/vllm_ready.py``), with what vLLM reports of its prefix
caching. Here: the line a deploy shows for it (:func:`observed_line`, the ``vllm.kv_report`` operation), and what a
valid one holds (:func:`parse_observed`; :mod:`gpufleet.rollout.observed` reads them from the nodes for
``gpufleet plan --observed``).
"""

from __future__ import annotations

import json
from typing import Any

from gpufleet.node.vllm_ready import kv_summary

NOT_YET = "vLLM's figure is not recorded yet (observed.json is written when the replica starts)"
PREFIX_CACHING_OFF = ("under router_policy prefix, which sends each request to the replica that has its prefix cached:"
                      " turn vLLM's prefix caching on (vllm_extra_args enable-prefix-caching: true) or route by"
                      " leastconn")


def _valid(value: object, kind: type) -> bool:
    """Whether ``value`` is null or of ``kind`` (a bool is no int)."""
    return value is None or (isinstance(value, kind) and (kind is bool or not isinstance(value, bool)))


def parse_observed(text: str) -> dict[str, Any]:
    """An observed.json; ValueError, saying what is wrong, when it is not what the readiness wait writes."""
    try:
        doc = json.loads(text)
    except ValueError:
        raise ValueError(f"observed.json is not JSON: {text[:80]!r}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"observed.json is not a JSON object: {text[:80]!r}")
    tokens = doc.get("kv_cache_tokens")
    if not _valid(tokens, int) or (tokens or 0) < 0:
        raise ValueError(f"observed.json holds kv_cache_tokens {tokens!r}")
    for key, kind in (("block_size", int), ("enable_prefix_caching", bool), ("prefix_caching_hash_algo", str)):
        if not _valid(doc.get(key), kind):
            raise ValueError(f"observed.json holds {key} {doc[key]!r}")
    return doc


def prefix_caching_text(doc: dict[str, Any]) -> str | None:
    """What vLLM reported of its prefix caching: ``prefix caching on (sha256, block 16)``, ``prefix caching off``;
    None when it reported nothing of it."""
    enabled = doc.get("enable_prefix_caching")
    if enabled is None:
        return None
    if not enabled:
        return "prefix caching off"
    block_size = doc.get("block_size")
    details = [doc.get("prefix_caching_hash_algo"), None if block_size is None else f"block {block_size}"]
    shown = ", ".join(detail for detail in details if detail)
    return "prefix caching on" + (f" ({shown})" if shown else "")


def observed_line(planned: int, text: str | None, tolerance: float, prefix_routed: bool = False) -> tuple[bool, str]:
    """(whether the line is a warning; one line) from the text of a replica's observed.json (None: there is none):
    the plan's KV cache tokens beside vLLM's and what vLLM reports of its prefix caching. A warning when vLLM's
    tokens differ from the plan's by more than ``tolerance``, when the file cannot be read, or when the replica's
    pool routes by prefix (``prefix_routed``) and vLLM caches none."""
    if text is None:
        return False, f"KV cache planned {planned:,} tokens; {NOT_YET}"
    try:
        doc = parse_observed(text)
    except ValueError as exc:
        return True, f"KV cache planned {planned:,} tokens; {exc}"
    _, off, line = kv_summary(planned, doc.get("kv_cache_tokens"), tolerance)
    if caching := prefix_caching_text(doc):
        line += f"; {caching}"
    if prefix_routed and doc.get("enable_prefix_caching") is False:
        return True, f"{line} {PREFIX_CACHING_OFF}"
    return off, line
