"""GPU facts from live hosts: a pyinfra fact that runs the NVML probe, and the fleet's health gate.

The fact itself is :class:`gpufleet.facts.gpu.NvmlGpuFacts`; pyinfra does not cache facts, so each host is
probed once per command and the result kept, as :func:`probe_hosts` does.

Hosts are probed through pyinfra's gevent pool; SSH hosts run in parallel only in a process that
gevent has monkey-patched at start (pyinfra's CLI does; ``gpufleet`` leaves that to its entry point).
"""

from __future__ import annotations

import contextlib
import runpy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyinfra.api.config import Config
from pyinfra.api.connect import connect_all, disconnect_all
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.facts import get_facts
from pyinfra.api.inventory import Inventory
from pyinfra.api.state import State

from gpufleet.facts.gpu import NvmlGpuFacts
from gpufleet.gpu.report import FactsError, NodeFacts, parse_facts
from gpufleet.node import health_rules
from gpufleet.node.health_rules import Failure, HealthPolicy


@dataclass
class ProbeRun:
    """Facts of every host that answered, and why each other host has none."""

    facts: dict[str, NodeFacts] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)


def probe_hosts(inventory: Inventory, python: str = "python3") -> ProbeRun:
    """Probe every host of a fresh ``Inventory`` once, in parallel (a new ``State`` per call)."""
    state = State(inventory, Config())
    run = ProbeRun()
    with contextlib.suppress(PyinfraError):  # every host failed to connect: reported below
        connect_all(state)
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


def load_inventory(inventory_path: str | Path, override_data: dict[str, Any] | None = None) -> Inventory:
    """A new pyinfra ``Inventory`` from an inventory file, grouped as pyinfra's CLI groups it.

    Module-level lists of hosts (or ``(hosts, data)``) are groups, ``all`` (when absent, every host)
    holds the hosts, and the file's own name is a group of them all; ``override_data`` is what pyinfra's
    ``--data`` gives every host. Read without ``pyinfra_cli``, whose import monkey-patches the whole process
    for gevent.
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
    return Inventory((hosts, data), override_data=override_data, **groups)


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
