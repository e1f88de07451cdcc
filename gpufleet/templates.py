"""gpufleet's Jinja templates (``templates/``), rendered as pyinfra's ``files.template`` renders them.

One environment, with pyinfra's settings (undefined names are errors, a trailing newline is kept) and a loader
rooted at ``templates/``, so a unit can ``{% include "_sandbox.conf.j2" %}`` (the systemd sandbox every unit
shares). Template names are relative to ``templates/``: ``"vllm/vllm@.service.j2"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined

TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "templates"


def jinja_env_kwargs() -> dict[str, Any]:
    """``files.template(jinja_env_kwargs=...)``: the loader that finds includes below ``templates/``.

    A new dict on every call: pyinfra pops the loader out of the dict it is given.
    """
    return {"loader": FileSystemLoader(TEMPLATES_DIR)}


ENV = Environment(undefined=StrictUndefined, keep_trailing_newline=True, **jinja_env_kwargs())


def render(name: str, **values: Any) -> str:
    """``templates/<name>`` rendered on the controller with ``values``, as a deploy writes it."""
    return ENV.get_template(name).render(**values)
