"""A node's GPUs as the NVML probe reports them (the document: :mod:`gpufleet.gpu.report`)."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import zlib
from pathlib import Path
from typing import Any

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.exceptions import FactProcessError, PyinfraError
from pyinfra.api.facts import FactBase

from gpufleet.node_paths import NODE_PYNVML

PROBE_SOURCE = Path(__file__).resolve().parents[1] / "node" / "nvml_probe.py"


def _packed(source: bytes) -> str:
    return base64.b64encode(zlib.compress(source, 9)).decode()


def controller_pynvml() -> Path:
    """The controller's ``pynvml.py`` (nvidia-ml-py), which the common role copies to the node's tools."""
    spec = importlib.util.find_spec("pynvml")
    if spec is None or spec.origin is None:
        raise PyinfraError("nvidia-ml-py (module pynvml) is not installed on the controller")
    return Path(spec.origin)


def probe_command_line(python: str = "python3") -> StringCommand:
    """``python -c <probe source> --compact``: the probe travels inside the command (compressed), since a
    fact cannot upload files. The NVML bindings it imports: the node Python's own ``pynvml``; else the copy
    of the controller's in the node's tools (``NODE_PYNVML``, imported from its cached bytecode) when it is
    byte for byte the controller's; else the controller's, also inside the command (a bare node): about 75 KB
    in all."""
    bindings = controller_pynvml().read_bytes()
    code = (
        "import base64,hashlib,sys,types,zlib\n"
        "def _unpack(s): return zlib.decompress(base64.b64decode(s))\n"
        "def _ours():\n"
        f" sys.path.insert(0, {str(Path(NODE_PYNVML).parent)!r})\n"
        " try:\n  import pynvml\n  ok = hashlib.sha256(open(pynvml.__file__, 'rb').read()).hexdigest() == "
        f"{hashlib.sha256(bindings).hexdigest()!r}\n"
        " except Exception:\n  ok = False\n"
        " sys.path.pop(0)\n"
        " if not ok:\n  sys.modules.pop('pynvml', None)\n"
        " return ok\n"
        "try:\n import pynvml\n"
        "except ImportError:\n"
        " if not _ours():\n"
        "  _m = sys.modules['pynvml'] = types.ModuleType('pynvml'); _m.__file__ = 'pynvml.py'\n"
        f"  exec(compile(_unpack('{_packed(bindings)}'), 'pynvml.py', 'exec'), _m.__dict__)\n"
        f"exec(compile(_unpack('{_packed(PROBE_SOURCE.read_bytes())}'), 'nvml_probe.py', 'exec'))\n"
    )
    return StringCommand(QuoteString(python), "-c", QuoteString(code), "--compact")


class NvmlGpuFacts(FactBase[dict[str, Any] | None]):  # None: the probe printed nothing (pyinfra's default)
    """
    Returns the host's GPU facts document (``gpufleet.gpu-facts/1``, see ``gpufleet.gpu.report``) as
    printed by the NVML probe. A host without a usable NVIDIA driver answers with
    ``nvml.available`` false; a host without ``python`` fails the fact, loudly.

    + python: interpreter on the host that has nvidia-ml-py (``pynvml``)

    Not cached by pyinfra: probe once per host per deploy and keep the result.

    .. code:: python

        {"schema": "gpufleet.gpu-facts/1", "hostname": "gpu-a01", "driver_version": "580.95.05",
         "gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", ...}], "topology": [["X", "NV18"], ...], ...}

    The whole document, field by field: :mod:`gpufleet.gpu.report`.
    """

    # No requires_command: pyinfra would quietly return the default when python is missing, and a
    # node that cannot be probed must fail the gate, not vanish from it.

    def command(self, python: str = "python3") -> StringCommand:
        return probe_command_line(python)

    def process(self, output: list[str]) -> dict[str, Any]:
        text = "\n".join(output).strip()
        try:
            doc = json.loads(text.splitlines()[-1] if text else "")
        except json.JSONDecodeError:
            raise FactProcessError(f"the NVML probe printed no facts JSON: {text[-300:]!r}") from None
        if not isinstance(doc, dict):
            raise FactProcessError(f"the NVML probe printed {type(doc).__name__}, expected a JSON object")
        return doc
