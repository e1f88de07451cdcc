"""GPU facts from live hosts: a pyinfra fact that runs the NVML probe, and the fleet's health gate.

pyinfra does not cache facts: every ``host.get_fact(NvmlGpuFacts)`` runs the probe again. Probe each
host once per deploy and keep the result, as :func:`probe_hosts` does.

Hosts are probed through pyinfra's gevent pool; SSH hosts run in parallel only in a process that
gevent has monkey-patched at start (pyinfra's CLI does; ``gpufleet`` leaves that to its entry point).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import runpy
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.config import Config
from pyinfra.api.connect import connect_all, disconnect_all
from pyinfra.api.exceptions import FactProcessError, PyinfraError
from pyinfra.api.facts import FactBase, get_facts
from pyinfra.api.inventory import Inventory
from pyinfra.api.state import State

from gpufleet.gpu_facts import FactsError, NodeFacts, parse_facts
from gpufleet.node import health_rules
from gpufleet.node.health_rules import Failure, HealthPolicy

PROBE_SOURCE = Path(__file__).with_name("node") / "nvml_probe.py"


def _packed(source: bytes) -> str:
    return base64.b64encode(zlib.compress(source, 9)).decode()


def _controller_pynvml() -> bytes:
    spec = importlib.util.find_spec("pynvml")
    if spec is None or spec.origin is None:
        raise PyinfraError("nvidia-ml-py (module pynvml) is not installed on the controller")
    return Path(spec.origin).read_bytes()


def probe_command_line(python: str = "python3") -> StringCommand:
    """``python -c <probe source> --compact``: the probe travels inside the command (compressed), since a
    fact cannot upload files. So does the controller's pure-Python ``pynvml``, used only where the node's
    Python has none (a bare node, before any virtualenv exists): about 75 KB in all."""
    code = (
        "import base64,sys,types,zlib\n"
        "def _unpack(s): return zlib.decompress(base64.b64decode(s))\n"
        "try:\n import pynvml\n"
        "except ImportError:\n"
        " _m = sys.modules['pynvml'] = types.ModuleType('pynvml'); _m.__file__ = 'pynvml.py'\n"
        f" exec(compile(_unpack('{_packed(_controller_pynvml())}'), 'pynvml.py', 'exec'), _m.__dict__)\n"
        f"exec(compile(_unpack('{_packed(PROBE_SOURCE.read_bytes())}'), 'nvml_probe.py', 'exec'))\n"
    )
    return StringCommand(QuoteString(python), "-c", QuoteString(code), "--compact")


class NvmlGpuFacts(FactBase[dict[str, Any]]):
    """
    Returns the host's GPU facts document (``gpufleet.gpu-facts/1``, see ``gpufleet.gpu_facts``) as
    printed by the NVML probe. A host without a usable NVIDIA driver answers with
    ``nvml.available`` false; a host without ``python`` fails the fact, loudly.

    + python: interpreter on the host that has nvidia-ml-py (``pynvml``)

    Not cached by pyinfra: probe once per host per deploy and keep the result.

    .. code:: python

        {
            "schema": "gpufleet.gpu-facts/1",
            "hostname": "gpu-a01",
            "nvml": {"available": True, "error": None},
            "driver_version": "580.95.05",
            "cuda_driver_version": "13.0",
            "nvml_version": "13.580.95.05",
            "gpus": [
                {"index": 0, "name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "00000000:18:00.0",
                 "persistence_mode": True, "nvlinks": [{"link": 0, "active": True, ...}, ...],
                 "fabric": {"state": "completed", "status": "success", ...}, "unsupported": [], ...},
            ],
            "topology": [["X", "NV18"], ["NV18", "X"]],
            "errors": [],
        }
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


@dataclass
class ProbeRun:
    """Facts of every host that answered, and why each other host has none."""

    facts: dict[str, NodeFacts] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)


class ProbeError(Exception):
    """Some hosts could not be probed; ``run`` holds what was learnt."""

    def __init__(self, run: ProbeRun) -> None:
        super().__init__("; ".join(f"{host}: {why}" for host, why in run.failures.items()))
        self.run = run


def probe_hosts(inventory: Inventory, python: str = "python3") -> ProbeRun:
    """Probe every host of a fresh ``Inventory`` once, in parallel (a new ``State`` per call)."""
    state = State(inventory, Config())
    run = ProbeRun()
    try:
        connect_all(state)
    except PyinfraError:
        pass  # every host failed to connect: reported below
    try:
        results = get_facts(state, NvmlGpuFacts, kwargs={"python": python, "_ignore_errors": True}) \
            if state.active_hosts else {}
    finally:
        disconnect_all(state)
    for host in inventory:
        if host not in results:
            run.failures[host.name] = "cannot connect (pyinfra's log above says why)"
        elif results[host] is None:
            run.failures[host.name] = (f"the NVML probe gave no facts: is {python} (with nvidia-ml-py) "
                                       "on the host? (its output is above)")
        else:
            try:
                run.facts[host.name] = parse_facts(results[host], f"{host.name}: probe output")
            except FactsError as exc:
                run.failures[host.name] = str(exc)
    return run


def _group(value: Any) -> tuple[list[Any], dict[str, Any]] | None:
    """``hosts`` or ``(hosts, data)`` where each host is a name or ``(name, data)``; else ``None``."""
    hosts, data = value if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict) else (value, {})
    if not isinstance(hosts, list) or not all(
            isinstance(h, str) or (isinstance(h, tuple) and len(h) == 2 and isinstance(h[0], str)) for h in hosts):
        return None
    return hosts, dict(data)


def load_inventory(inventory_path: str | Path) -> Inventory:
    """A new pyinfra ``Inventory`` from an inventory file, grouped as pyinfra's CLI groups it.

    Module-level lists of hosts (or ``(hosts, data)``) are groups, ``all`` (when absent, every host)
    holds the hosts, and the file's own name is a group of them all. Read without ``pyinfra_cli``,
    whose import monkey-patches the whole process for gevent.
    """
    path = Path(inventory_path)
    namespace = runpy.run_path(str(path), run_name="gpufleet_inventory")
    groups = {name: group for name, value in namespace.items()
              if not name.startswith("_") and (group := _group(value)) is not None}
    hosts, data = groups.pop("all", ([], {}))
    if not hosts:
        names = [h if isinstance(h, str) else h[0] for group_hosts, _ in groups.values() for h in group_hosts]
        hosts = list(dict.fromkeys(names))
    groups.setdefault(path.stem, (list(hosts), {}))
    return Inventory((hosts, data), **groups)


def probe_inventory(inventory_path: str | Path, python: str = "python3") -> dict[str, NodeFacts]:
    """Facts of every host of an inventory file, by inventory host name; ``ProbeError`` if any has none."""
    run = probe_hosts(load_inventory(inventory_path), python)
    if run.failures:
        raise ProbeError(run)
    return run.facts


def default_policy(host: str) -> HealthPolicy:
    """The built-in policy, until a host's ``gpu_health`` config supplies one."""
    return HealthPolicy()


@dataclass(frozen=True)
class GateReport:
    """One verdict per host (``health_rules.verdict``): probed hosts in order, then unprobed ones."""

    verdicts: list[dict[str, Any]]

    @property
    def passed(self) -> bool:
        return all(v["passed"] for v in self.verdicts)

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "hosts": self.verdicts}

    def text(self) -> str:
        failed = sum(not v["passed"] for v in self.verdicts)
        lines = [health_rules.format_verdict(v) for v in self.verdicts]
        lines.append(f"gpu gate: {len(self.verdicts) - failed} of {len(self.verdicts)} nodes pass"
                     + (f", {failed} fail" if failed else ""))
        return "\n".join(lines)


def gate_report(facts: Mapping[str, NodeFacts], policy_for_host: Callable[[str], HealthPolicy] = default_policy,
                unprobed: Mapping[str, str] | None = None) -> GateReport:
    """Judge every host's facts with its policy; hosts in ``unprobed`` (host -> reason) fail rule ``probe``."""
    verdicts = []
    for host, node in facts.items():
        doc = node.model_dump(mode="json", by_alias=True)
        verdicts.append(health_rules.verdict(doc, health_rules.evaluate(doc, policy_for_host(host)), host=host))
    for host, reason in (unprobed or {}).items():
        verdicts.append(health_rules.verdict({}, [Failure("probe", None, reason)], host=host))
    return GateReport(verdicts)
