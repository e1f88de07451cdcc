"""A replica's release: the values of the variables that say what it runs, as recorded on its nodes.

The vllm role writes them to ``/etc/gpufleet/vllm/<replica>/release.json`` (root, 0644) on every node that runs
the replica's vLLM process, with every deploy and without restarting anything. ``gpufleet upgrade`` copies that
file to ``release.previous.json`` before a change of release reaches the node, and gives a release back to a
deploy as ``pyinfra --data KEY=VALUE`` arguments (:func:`data_items`) to roll a replica back.

The file is stable JSON (sorted keys, no timestamp): a deploy that changes nothing writes nothing. It never holds
a secret (:data:`gpufleet.config.schema.SECRET_KEYS` are references, and none is a release key).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gpufleet.config.schema import HostConfig, keys

Release = dict[str, Any]
"""Release keys and their values, as JSON has them (lists, mappings, text, numbers, booleans, null)."""

RELEASE_KEYS = keys(release=True)
"""What makes a release: the software (vLLM, its lock and wheels, Ray), the model and how it is served."""

MAX_BYTES = 1 << 20  # a release record is a few hundred bytes; anything larger is not one


class ReleaseError(ValueError):
    """A release record that cannot be read back: one line, naming where it came from."""


def release_of(cfg: HostConfig) -> Release:
    """The release a host's configuration gives its replicas, normalised as JSON reads it back."""
    values = cfg.model_dump(mode="json", include=set(RELEASE_KEYS), exclude_none=False)
    loaded: Release = json.loads(json.dumps({key: values[key] for key in RELEASE_KEYS}))
    return loaded


def release_json(release: Mapping[str, Any]) -> str:
    """The text of ``release.json``: sorted keys, two-space indent, ASCII, a final newline."""
    return json.dumps(dict(release), sort_keys=True, indent=2, ensure_ascii=True) + "\n"


def parse_release(text: str, where: str) -> Release:
    """A ``release.json`` read back: its release keys (a key this gpufleet does not know is left out, so it never
    reaches ``--data``); ReleaseError when it is no JSON object."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ReleaseError(f"{where}: expected a release record (JSON), found invalid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ReleaseError(f"{where}: expected a release record (a JSON object), found {type(doc).__name__}")
    return {key: doc[key] for key in RELEASE_KEYS if key in doc}


def data_value(value: Any) -> str:
    """``value`` as the text of a ``--data KEY=VALUE`` that pyinfra reads back as ``value``.

    pyinfra reads a value as true/false, then an integer, then JSON, then text (``parse_cli_arg``). Compact JSON
    keeps each type: a text is quoted, so ``"0123"`` or ``"true"`` stays text; numbers, booleans, null, lists and
    mappings are JSON's own; everything is ASCII (other characters escaped)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def data_items(release: Mapping[str, Any]) -> list[str]:
    """``KEY=VALUE`` items for pyinfra's ``--data``, in :data:`RELEASE_KEYS` order; only release keys."""
    return [f"{key}={data_value(release[key])}" for key in RELEASE_KEYS if key in release]


def overrides(target: Mapping[str, Any], inventory: Mapping[str, Any]) -> Release:
    """What a deploy must be told to give a replica ``target`` instead of ``inventory`` (the release its
    configuration gives it): the release keys whose values differ."""
    return {key: target[key] for key in RELEASE_KEYS if key in target and target[key] != inventory.get(key)}


def changes(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> str:
    """``before -> after`` in a few words: the keys whose values differ, or ``unchanged``."""
    if before is None or after is None:
        shown = {key: (after or before or {}).get(key) for key in ("vllm_version", "vllm_model_revision")}
        side = ", ".join(f"{k} {data_value(v)}" for k, v in shown.items() if v is not None) or "a release"
        return f"unknown -> {side}" if before is None else f"{side} -> unknown"
    differ = [f"{key} {data_value(before.get(key))} -> {data_value(after.get(key))}"
              for key in RELEASE_KEYS if key in after and before.get(key) != after[key]]
    return "; ".join(differ) or "unchanged"
