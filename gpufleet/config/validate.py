"""Check one host's merged values against the schema and say what is wrong in operators' words."""

from __future__ import annotations

import difflib
import functools
from typing import Any

from pydantic import ValidationError

from gpufleet.config.layers import HostLayers, is_role_default
from gpufleet.config.schema import SCHEMA_KEYS, SECRET_KEYS, SECRET_TREES, HostConfig, shown_in_tree
from gpufleet.pyinfra_seam import connector_data_keys, global_argument_names
from gpufleet.values import grammar, limits
from gpufleet.values.problems import KeyedError, Problem, shown_key


@functools.cache
def pyinfra_keys() -> frozenset[str]:
    """The host data keys pyinfra itself reads, from the installed pyinfra (so an upgrade that adds or drops one
    changes what gpufleet accepts with it): its connectors' data keys (``ssh_user``…) and its global operation
    arguments (``_sudo``…)."""
    return frozenset({name for name in global_argument_names() if name.startswith("_")} | connector_data_keys())


# How to say what a field accepts when pydantic reports one error per union member.
_UNION_EXPECTED = {
    "vllm_tensor_parallel_size": f"an integer from 1 to {limits.REPLICA_MAX_RANKS} or auto",
    "vllm_pipeline_parallel_size": f"an integer from 1 to {limits.REPLICA_MAX_RANKS} or auto",
    "vllm_nodes_per_replica": f"an integer from 1 to {limits.REPLICA_MAX_RANKS} or auto",
    "vllm_replicas_per_node": f"an integer from 1 to {limits.NODE_MAX_GPUS} or auto",
}


def _found(value: Any) -> str:
    """A value as a refusal shows it: cut short, a URL's credentials in it never shown."""
    if isinstance(value, str) or value is None:
        return grammar.show(grammar.without_credentials(value) if value else value)
    text = grammar.without_credentials(repr(value))  # a list or mapping holding a URL
    return text if len(text) <= 60 else text[:57] + "..."


def is_secret_path(key: str, value: Any = None) -> bool:
    """Whether ``value``, found at a key path, may be a secret, and must never be shown: a secret variable's, any
    under :data:`SECRET_TREES` (but what :func:`shown_in_tree` shows), or one whose key names a secret
    (``*_TOKEN``, or a bare ``key``, ``token``, ``secret``)."""
    parts = key.replace("[", ".").split(".")
    if parts[0] in SECRET_TREES:
        return not shown_in_tree(parts[-1], value)
    return parts[0] in SECRET_KEYS or any(grammar.names_secret(p) for p in parts[1:])


def _control_problems(key: str, value: Any, depth: int = 0) -> list[tuple[str, str]]:
    """(key path, problem) for every text, key included, holding a control character."""
    if depth > 50:
        return [(key, "expected values nested at most 50 levels deep, found deeper")]
    found: list[tuple[str, str]] = []
    if isinstance(value, str):
        if ch := grammar.control_char(value):
            found.append((key, f"expected text without control characters, found {ch} in it"))
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and (ch := grammar.control_char(k)):
                found.append((key, f"expected keys without control characters, found {ch} in one"))
            else:
                found += _control_problems(f"{key}.{shown_key(str(k))}", v, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found += _control_problems(f"{key}[{i}]", item, depth + 1)
    return found


def _expected(err: dict[str, Any]) -> str:
    kind, ctx = err["type"], err.get("ctx", {})
    simple = {
        "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
        "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
        "bool_type": "true or false", "bool_parsing": "true or false",
        "string_type": "text", "dict_type": "a mapping", "list_type": "a list",
        "model_type": "a mapping", "model_attributes_type": "a mapping", "tuple_type": "a list of two ports",
        "extra_forbidden": "no such key here", "unexpected_keyword_argument": "no such key here",
    }
    if kind in simple:
        return simple[kind]
    if kind == "literal_error":
        return f"one of {ctx.get('expected', '').replace(chr(39), '').replace(' or ', ', ')}"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        if isinstance(limit, (int, float)):
            return f"a number {bounds[kind]} {_number(limit)}"
        return f"a value {bounds[kind]} {limit}"
    if kind == "string_pattern_mismatch":
        return f"text matching {ctx.get('pattern')}"
    return str(err["msg"])


def _number(value: float) -> str:
    """A limit as a message shows it: an integer as the integer it is (``1000000``, never ``1e+06``)."""
    return str(int(value)) if isinstance(value, int) or value.is_integer() else repr(value)


def _kind(value: Any) -> str:
    """What a value is, as a message names it without showing it."""
    for types, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "text"),
                        (list, "a list"), (dict, "a mapping")):
        if isinstance(value, types):
            return name
    return "a value"


def _message(err: dict[str, Any], secret: bool) -> str:
    if err["type"] == "missing" or (err.get("input", "") is None and err["type"].endswith("_type")):
        return "expected a value, found nothing (required)"
    hidden = f"{_kind(err.get('input'))} (not shown: it may be a secret)"
    if err["type"] == "value_error":
        error = err.get("ctx", {}).get("error", err["msg"])
        text = error.message if isinstance(error, KeyedError) else str(error)
        return text.replace(f"found {_found(err.get('input'))}", f"found {hidden}") if secret else text
    found = hidden if secret else _found(err.get("input"))
    if err["type"] in ("float_parsing", "float_type") and type(err.get("input")) is int:  # too large to convert
        digits = str(err["input"])
        return f"expected a number a 64-bit float holds, found {digits[:12]}... ({len(digits.lstrip('-'))} digits)"
    return f"expected {_expected(err)}, found {found}"


def _sub_key(err: dict[str, Any]) -> str:
    """The key below the field that a validator blamed (``KeyedError``), if any."""
    error = err.get("ctx", {}).get("error") if err["type"] == "value_error" else None
    if not isinstance(error, KeyedError) or not error.key:
        return ""
    return error.key if error.key.startswith("[") else "." + shown_key(error.key)


def _key_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
        elif parts and ("[" in item or item in ("int", "float", "str", "bool", "constrained-int")):
            continue  # a union member's tag, not a key
        else:
            parts.append(shown_key(item) if parts else item)
    return ".".join(parts)


def _top(key: str) -> str:
    """The variable a key path starts with."""
    return key.split(".")[0].split("[")[0]


def did_you_mean(key: str, known: frozenset[str]) -> str:
    """``; did you mean <the nearest known key>?`` (case ignored), or nothing when none is near."""
    lowered = {name.lower(): name for name in known}
    near = difflib.get_close_matches(key.lower(), sorted(lowered), n=1, cutoff=0.6)
    return f"; did you mean {lowered[near[0]]}?" if near else ""


def unknown_key_problems(values: dict[str, Any], sources: dict[str, str], host: str) -> list[Problem]:
    """Keys neither the schema nor pyinfra (its connectors' data, its global arguments) knows, with the nearest
    known key."""
    problems = []
    for key in values:
        if grammar.control_char(key) or not key.isascii() or not key.isprintable() or " " in key:
            problems.append(
                Problem(sources[key], grammar.show(key), "expected a variable name, found this key", (host,))
            )
            continue
        if key in SCHEMA_KEYS or key in pyinfra_keys():
            continue
        hint = did_you_mean(key, SCHEMA_KEYS | pyinfra_keys())
        problems.append(Problem(sources[key], key, f"expected a known variable, found an unknown key{hint}", (host,)))
    return problems


def connector_value_problems(values: dict[str, Any], sources: dict[str, str], host: str) -> list[Problem]:
    """pyinfra's connector data that pyinfra would take or refuse only once it connects: a port (``ssh_port``...)
    must be a whole number from 1 to 65535, a count of tries (``ssh_connect_retries``) a whole number from 0."""
    problems = []
    for key, value in values.items():
        if key not in pyinfra_keys() or key.startswith("_"):
            continue
        whole = isinstance(value, int) and not isinstance(value, bool)
        if key.endswith("_port") and value is not None and not (whole and 1 <= value <= 65535):
            problems.append(Problem(sources[key], key, f"expected a port from 1 to 65535, found {_found(value)}",
                                    (host,)))
        elif key.endswith("_retries") and value is not None and not (whole and value >= 0):
            problems.append(Problem(sources[key], key, f"expected a whole number from 0, found {_found(value)}",
                                    (host,)))
    return problems


def validate_host(layers: HostLayers, fallback_source: str, api_ports: int | None = None,
                  serving: bool = True, routes: bool = True) -> tuple[HostConfig | None, list[Problem]]:
    """Validate one host; problems name the file each bad value came from.

    ``api_ports``: how many replicas the plan puts on the host, when it is known. ``serving``: whether the host is
    in a serving pool (a dedicated router or monitoring host is not, and needs no ``vllm_model``). ``routes``:
    whether it is a router (its ports clear of the routers' own; elsewhere nothing listens on those).
    """
    values, sources = layers.merged()
    host = layers.name
    problems = unknown_key_problems(values, sources, host) + connector_value_problems(values, sources, host)
    known = {k: v for k, v in values.items() if k in SCHEMA_KEYS}
    control = [Problem(sources[key], path, message, (host,))
               for key, value in known.items() for path, message in _control_problems(key, value)]
    if control:
        return None, problems + control
    try:
        config = HostConfig(**known)
    except ValidationError as exc:
        seen: set[str] = set()
        for details in exc.errors():
            err: dict[str, Any] = dict(details)
            key = _key_path(err["loc"]) + _sub_key(err)
            top = key.split(".")[0].split("[")[0]
            if key in seen:
                continue
            seen.add(key)
            if top in _UNION_EXPECTED and err["type"] != "missing":
                message = f"expected {_UNION_EXPECTED[top]}, found {_found(values.get(top))}"
            else:
                message = _message(err, is_secret_path(key, err.get("input")))
            source = sources.get(top, fallback_source)
            if values.get(top) is None and is_role_default(source):
                source = fallback_source  # a required value nobody set: the inventory must set it
            problems.append(Problem(source, key, message, (host,)))
        return None, problems
    if serving and config.vllm_model is None:
        source = sources.get("vllm_model", fallback_source)
        problems.append(Problem(fallback_source if is_role_default(source) else source, "vllm_model",
                                "expected a value, found nothing (required)", (host,)))
    for keys, message in config.contradictions(api_ports, routes):
        chosen = next((k for k in keys if not is_role_default(sources.get(_top(k), ""))), keys[0])
        problems.append(Problem(sources.get(_top(chosen), fallback_source), chosen, message, (host,)))
    return (config if not problems else None), problems
