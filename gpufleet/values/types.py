"""The kinds of value several roles' settings share: ports, counts, seconds, checked text and secret references.

Types are strict: ``true`` is not 1 and ``"8000"`` is not 8000; a float accepts an integer. What a well-formed name,
address, URL or path is lives in :mod:`gpufleet.values.grammar`; each check's docstring is the rule the variables
reference shows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from gpufleet.values import grammar, limits
from gpufleet.values.problems import KeyedError

Auto = Literal["auto"]
FIRST_UNPRIVILEGED_PORT = 1024
"""gpufleet's services run with an empty capability bounding set (templates/_sandbox.conf.j2): none can bind a port
below this one."""


def _unprivileged(port: int) -> int:
    """At least 1024: gpufleet's services run without the capability to bind a lower port."""
    if port < FIRST_UNPRIVILEGED_PORT:
        raise ValueError(f"expected a port from {FIRST_UNPRIVILEGED_PORT} to 65535 (the service runs without the"
                         f" capability to bind ports below {FIRST_UNPRIVILEGED_PORT}), found {port}")
    return port


Port = Annotated[int, Field(ge=1, le=65535), AfterValidator(_unprivileged)]


def limit(check: Callable[[int], str | None]) -> AfterValidator:
    """An after-validator from a check of :mod:`gpufleet.values.limits`."""

    def validate(value: int) -> int:
        if problem := check(value):
            raise ValueError(problem)
        return value

    validate.__doc__ = check.__doc__  # what the rule is, for the reference (scripts/gen_docs.py)
    return AfterValidator(validate)


RanksInt = Annotated[int, Field(ge=1, le=limits.REPLICA_MAX_RANKS)]
SystemdSeconds = Annotated[int, Field(ge=1), limit(limits.systemd_seconds)]
"""Seconds that reach a unit's time span or a node's wait."""


def checked(check: Callable[[str], str | None]) -> Callable[[Any], Any]:
    """A before-validator from a grammar check (non-text values are left to the type check)."""

    def validate(value: Any) -> Any:
        if isinstance(value, str) and (problem := check(value)):
            raise ValueError(problem)
        return value

    validate.__doc__ = check.__doc__  # what the rule is, for the reference (scripts/gen_docs.py)
    return validate


def each(check: Callable[[str], str | None]) -> Callable[[Any], Any]:
    """A before-validator that applies a grammar check to every text item of a list."""

    def validate(value: Any) -> Any:
        if isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, str) and (problem := check(item)):
                    raise KeyedError(f"[{i}]", problem)
        return value

    validate.__doc__ = f"Each item: {check.__doc__}" if check.__doc__ else None
    return validate


def text(check: Callable[[str], str | None]) -> Any:
    return Annotated[str, BeforeValidator(checked(check))]


def served_name(value: str) -> str | None:
    """A served model name: up to 128 characters, starting with a letter or digit, no control character, no trailing
    blank."""
    if grammar.SERVED_NAME.match(value):
        return None
    return ("expected a model name (up to 128 characters, starting with a letter or digit, no control"
            f" character, no trailing blank), found {grammar.show(value)}")


def secret_ref(value: Any) -> Any:
    """A secret's value is a reference; whatever else is found is named by its type, never shown."""
    if isinstance(value, str):
        raise ValueError(
            "expected a reference {env: NAME} or {file: PATH}, found a literal string"
            " (secrets never live in inventories or group_vars)"
        )
    if value is not None and not isinstance(value, (dict, SecretRef)):
        found = {list: "a list", bool: "true or false", int: "a number", float: "a number"}.get(type(value), "a value")
        raise ValueError(f"expected a reference {{env: NAME}} or {{file: PATH}}, found {found} (not shown: it may be"
                         " a secret)")
    return value


class SecretRef(BaseModel):
    """Where a secret is read on the controller: an environment variable or a file."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    env: text(grammar.env_name) | None = None  # type: ignore[valid-type]
    file: text(grammar.controller_path) | None = None  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _exactly_one(self) -> SecretRef:
        """Exactly one of ``env`` and ``file``."""
        if (self.env is None) == (self.file is None):
            raise ValueError("expected exactly one of env or file")
        return self


OptionalSecret = Annotated[SecretRef | None, BeforeValidator(secret_ref)]
"""A secret variable's value: a reference, or null."""
