"""Check one host's merged values against the schema and say what is wrong in operators' words."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import ValidationError

from gpufleet.config.layers import HostLayers, is_role_default
from gpufleet.config.problems import Problem
from gpufleet.config.schema import SCHEMA_KEYS, HostConfig

# Data keys that belong to pyinfra itself (connectors and global operation arguments).
PYINFRA_KEY_PREFIXES = ("ssh_", "winrm_", "docker_", "podman_", "chroot_", "local_", "_")

# How to say what a field accepts when pydantic reports one error per union member.
_UNION_EXPECTED = {
    "vllm_tensor_parallel_size": "an integer >= 1 or auto",
    "vllm_pipeline_parallel_size": "an integer >= 1 or auto",
    "vllm_nodes_per_replica": "an integer >= 1 or auto",
    "vllm_replicas_per_node": "an integer >= 1 or auto",
}


def _found(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _expected(err: dict[str, Any]) -> str:
    kind, ctx = err["type"], err.get("ctx", {})
    simple = {
        "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
        "float_type": "a number", "float_parsing": "a number",
        "bool_type": "true or false", "bool_parsing": "true or false",
        "string_type": "text", "dict_type": "a mapping", "list_type": "a list",
        "model_type": "a mapping", "model_attributes_type": "a mapping",
        "extra_forbidden": "no such key here", "unexpected_keyword_argument": "no such key here",
    }
    if kind in simple:
        return simple[kind]
    if kind == "literal_error":
        return f"one of {ctx.get('expected', '').replace(chr(39), '').replace(' or ', ', ')}"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"a number {bounds[kind]} {limit:g}" if isinstance(limit, (int, float)) else f"a value {bounds[kind]} {limit}"
    if kind == "string_pattern_mismatch":
        return f"text matching {ctx.get('pattern')}"
    return err["msg"]


def _message(err: dict[str, Any]) -> str:
    if err["type"] == "missing" or (err.get("input", "") is None and err["type"].endswith("_type")):
        return "expected a value, found nothing (required)"
    if err["type"] == "value_error":
        return str(err.get("ctx", {}).get("error", err["msg"]))
    return f"expected {_expected(err)}, found {_found(err.get('input'))}"


def _key_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
        elif parts and ("[" in item or item in ("int", "float", "str", "bool", "constrained-int")):
            continue  # a union member's tag, not a key
        else:
            parts.append(item)
    return ".".join(parts)


def unknown_key_problems(values: dict[str, Any], sources: dict[str, str], host: str) -> list[Problem]:
    """Keys neither the schema nor pyinfra knows, with the nearest known key."""
    problems = []
    for key in values:
        if key in SCHEMA_KEYS or key.startswith(PYINFRA_KEY_PREFIXES):
            continue
        near = difflib.get_close_matches(key, sorted(SCHEMA_KEYS), n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]}?" if near else ""
        problems.append(Problem(sources[key], key, f"expected a known variable, found an unknown key{hint}", (host,)))
    return problems


def validate_host(layers: HostLayers, fallback_source: str) -> tuple[HostConfig | None, list[Problem]]:
    """Validate one host; problems name the file each bad value came from."""
    values, sources = layers.merged()
    host = layers.name
    problems = unknown_key_problems(values, sources, host)
    known = {k: v for k, v in values.items() if k in SCHEMA_KEYS}
    try:
        config = HostConfig(**known)
    except ValidationError as exc:
        seen: set[str] = set()
        for details in exc.errors():
            err: dict[str, Any] = dict(details)
            key = _key_path(err["loc"])
            top = key.split(".")[0].split("[")[0]
            if key in seen:
                continue
            seen.add(key)
            if top in _UNION_EXPECTED and err["type"] != "missing":
                message = f"expected {_UNION_EXPECTED[top]}, found {_found(values.get(top))}"
            else:
                message = _message(err)
            source = sources.get(top, fallback_source)
            if values.get(top) is None and is_role_default(source):
                source = fallback_source  # a required value nobody set: the inventory must set it
            problems.append(Problem(source, key, message, (host,)))
        return None, problems
    for keys, message in config.contradictions():
        chosen = next((k for k in keys if not is_role_default(sources.get(k, ""))), keys[0])
        problems.append(Problem(sources.get(chosen, fallback_source), chosen, message, (host,)))
    return (config if not problems else None), problems
