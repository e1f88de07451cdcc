"""Each role's settings, one module per role; a variable is written once, as its record in its role's model.

A record is the field: its type and range are the annotation; :func:`setting` gives its default, its meaning and what
the rest of gpufleet derives from it (which hosts must agree on it, who reads it, whether it is a secret, whether it
makes a release, the vLLM flags and environment variables it owns). ``roles/<role>/defaults.yml`` and the variables
reference are written from the records (``make docs``), and every list of variables is derived from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Scope = Literal["host", "pool", "routers", "vrrp"]
ReadOn = Literal["any", "routers", "pools"]
Secrecy = Literal["", "reference", "env_file", "tree"]


@dataclass(frozen=True)
class Setting:
    """A variable's record, besides its type.

    - ``doc``: what it means, as its role's defaults.yml and the reference say it (a line that starts with a blank is
      kept as written: a table or an example);
    - ``section``: the heading it is listed under in its role's defaults.yml, if any;
    - ``scope``: who must agree on it: each host alone, every host of one pool (one model, one layout), every
      router (what clients see of the edge), or every router of the VRRP group (the virtual address's group);
    - ``model_wide``: why every pool that serves one model name must agree on it ("": they need not);
    - ``read_on``: where gpufleet reads it: any host, the routers only (set elsewhere it is refused), or the serving
      pools only (set only for routers that serve nothing it is refused);
    - ``secret``: "" (shown), ``reference`` (a secret reference read on the controller), ``env_file`` (one that
      reaches a node in a 0600 EnvironmentFile), ``tree`` (secret references among other values);
    - ``release``: part of a release (what a rollout moves and rolls back);
    - ``owned_flags``, ``owned_env``: vLLM flags and environment variables gpufleet writes from it (refused in
      ``vllm_extra_args`` and ``vllm_env``).
    """

    name: str
    role: str
    default: Any
    doc: str
    section: str = ""
    scope: Scope = "host"
    model_wide: str = ""
    read_on: ReadOn = "any"
    secret: Secrecy = ""
    release: bool = False
    owned_flags: tuple[str, ...] = ()
    owned_env: tuple[str, ...] = ()


_META = "gpufleet"
SETTINGS_PACKAGE = "gpufleet.config.settings"


def setting(default: Any, doc: str, *, section: str = "", scope: Scope = "host", model_wide: str = "",
            read_on: ReadOn = "any", secret: Secrecy = "", release: bool = False, owned_flags: tuple[str, ...] = (),
            owned_env: tuple[str, ...] = ()) -> Any:
    """A variable's record: a pydantic field with its default and meaning, and the rest kept beside them."""
    meta: dict[str, Any] = {"section": section, "scope": scope, "model_wide": model_wide, "read_on": read_on,
                             "secret": secret, "release": release, "owned_flags": list(owned_flags),
                             "owned_env": list(owned_env)}
    return Field(default=default, description=doc, json_schema_extra={_META: meta})


class RoleSettings(BaseModel):
    """A role's settings: one field per variable, each a :func:`setting`. The class docstring is the role's."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, validate_default=True)


def records(model: type[BaseModel], role: str = "") -> dict[str, Setting]:
    """Every variable's record of a settings model (a role's, or one composed of several), in field order.
    ``role``: the role to name in each record (a composed model's records name it from :func:`role_of`)."""
    found: dict[str, Setting] = {}
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra
        meta = extra.get(_META) if isinstance(extra, dict) else None
        if not isinstance(meta, dict):
            raise TypeError(f"{model.__name__}.{name}: expected a setting(...), found a bare field")
        kept: dict[str, Any] = {key: tuple(value) if isinstance(value, list) else value for key, value in meta.items()}
        found[name] = Setting(name, role or role_of(model, name), field.default, field.description or "", **kept)
    return found


def role_of(model: type[BaseModel], name: str) -> str:
    """The role whose settings declare ``name``: the module of :mod:`gpufleet.config.settings` that holds it
    (``gpufleet.config.settings.vllm`` is role ``vllm``)."""
    for cls in model.__mro__:
        if (issubclass(cls, BaseModel) and cls.__module__.startswith(f"{SETTINGS_PACKAGE}.")
                and name in cls.model_fields):
            return cls.__module__.rpartition(".")[2]
    raise KeyError(f"{model.__name__}.{name}: declared by no role's settings")
