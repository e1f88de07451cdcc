"""The fleet's secrets, as ``gpufleet diag`` keeps them out of its archive: every value the controller can read from
the inventory's secret references, in each form it may take in collected text, replaced by ``[redacted]``.

This is the second line of defence. The first is what the nodes collect: never ``/etc/gpufleet/secrets`` nor a key
file, and every member's text already redacted by name on the node (:func:`gpufleet.node.diag_collect.redact_names`,
which this module applies again: the rank secret is drawn on the controller during a deploy and kept on the nodes
only, so it is known here by its name alone). No value is ever sent to a node, shown or logged; a secret that cannot
be read is named with why, never shown.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from pydantic import BaseModel

from gpufleet.config.schema import SECRET_KEYS, SECRET_TREES
from gpufleet.config.secrets import read_secret
from gpufleet.node.diag_collect import REDACTED, redact_names
from gpufleet.values.problems import ConfigError
from gpufleet.values.types import SecretRef

MIN_PART_CHARS = 6
"""The shortest part of a secret sought on its own (a line of a PEM key, the password of ``user:password``): a
shorter one would match ordinary text. The whole value is sought whatever its length."""


@dataclass
class Secrets:
    """Each secret variable's forms, as bytes; the lines of the references that could not be read (never a value)."""

    forms: dict[str, set[bytes]] = field(default_factory=dict)
    unread: list[str] = field(default_factory=list)

    def needles(self) -> list[tuple[bytes, str]]:
        """Every form with its variable, longest first (a value inside another is replaced after it)."""
        return sorted(((form, key) for key, forms in self.forms.items() for form in forms),
                      key=lambda pair: (-len(pair[0]), pair[1]))


def forms(value: str) -> set[str]:
    """The texts ``value`` may appear as: itself, JSON-escaped, URL-quoted; each line of a multi-line value (a PEM
    body line) and each side of ``user:password``, when long enough to be sought alone."""
    found = {value, json.dumps(value)[1:-1], quote(value, safe="")}
    parts = [line.strip() for line in value.splitlines()] if "\n" in value else value.split(":", 1)
    sought = [part for part in parts if len(part) >= MIN_PART_CHARS and not part.startswith("-----")]  # not markers
    found.update(sought)
    found.update(quote(part, safe="") for part in sought)
    return {text for text in found if text}


def _refs(value: Any) -> Iterator[SecretRef]:
    """The secret references within a setting's value (a reference, or a tree of them: the routers' clients)."""
    if isinstance(value, SecretRef):
        yield value
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from _refs(getattr(value, name))
    elif isinstance(value, dict):
        for item in value.values():
            yield from _refs(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _refs(item)


def fleet_secrets(configs: Iterable[Any]) -> Secrets:
    """Every secret the hosts' configurations reference, read on the controller as a deploy reads it."""
    found = Secrets()
    seen: set[SecretRef] = set()
    for cfg in configs:
        for key in sorted(SECRET_KEYS | SECRET_TREES):
            for ref in _refs(getattr(cfg, key, None)):
                if ref in seen:
                    continue
                seen.add(ref)
                try:
                    value = read_secret(ref, key, one_line=False)
                except ConfigError as error:
                    found.unread += [problem.line() for problem in error.problems]
                    continue
                found.forms.setdefault(key, set()).update(text.encode() for text in forms(value))
    return found


def redact(data: bytes, secrets: Secrets) -> tuple[bytes | None, Counter[str]]:
    """``data`` with every secret form and every secret named in it replaced, and how many of each (by variable;
    ``by name``: what the names gave away); None when a form still remains after (the member is left out)."""
    counts: Counter[str] = Counter()
    text, named = redact_names(data.decode("utf-8", "replace"))
    if named:
        counts["by name"] += named
    out = text.encode() if named else data
    needles = secrets.needles()
    for needle, key in needles:
        if needle in out:
            counts[key] += out.count(needle)
            out = out.replace(needle, REDACTED.encode())
    if any(needle in out for needle, _ in needles):
        return None, counts
    return out, counts
