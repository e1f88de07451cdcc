"""Probe this node's NVIDIA GPUs through NVML and print the GPU facts document (``gpufleet.gpu-facts/1``).

Runs on the node with ``python3`` and nvidia-ml-py (``pynvml``) only::

    python3 nvml_probe.py                        # print the facts JSON (``--compact``: one line)
    python3 nvml_probe.py --gate POLICY.json     # probe, judge with health_rules.py; exit 0 pass, 1 fail
    python3 nvml_probe.py --gate POLICY.json --json

A query the GPU answers with NOT_SUPPORTED (or a driver too old to have it) leaves its field ``null``
and its name in the GPU's ``unsupported``; any other NVML error leaves the field ``null`` and an entry
in ``errors``. Without a usable driver the document says ``"nvml": {"available": false, "error":
"no NVML on this node: ..."}`` and the probe still exits 0.

Topology labels follow ``nvidia-smi topo -m``: ``NV<n>`` where two GPUs share n direct active NVLinks
or both sit on a registered NVSwitch fabric (n: the smaller count of active switch links), otherwise
the PCIe common ancestor (``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``; ``N/A`` when NVML cannot say).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import os
import socket
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

try:
    import pynvml as nvml
except ImportError:  # reported by probe() as a node without NVML
    nvml = None

SCHEMA = "gpufleet.gpu-facts/1"
NO_NVML = "no NVML on this node"

# Bits of nvmlDeviceGetCurrentClocksEventReasons, named as in nvml.h (nvmlClocksEventReason*).
CLOCK_EVENT_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}

# nvmlGpuTopologyLevel_t -> nvidia-smi topo -m label.
TOPOLOGY_LABELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
FABRIC_STATES = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}
REMOTE_DEVICE_TYPES = {0: "gpu", 1: "ibmnpu", 2: "switch", 0xFF: "unknown"}

# NVML return codes (stable across NVML versions; named here so the probe imports without pynvml).
_NOT_SUPPORTED = 3
_INVALID_ARGUMENT = 2
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_ARGUMENT_VERSION_MISMATCH = 25
_ABSENT = (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND)

_AFFINITY_SCOPE_NODE = 0
_UNCORRECTED = 1
_VOLATILE, _AGGREGATE = 0, 1
_NODE_SET_WORDS = 4  # 256 NUMA nodes
_MIN_CPU_SET_WORDS = 16  # 1024 CPUs


class _Queries:
    """Runs NVML queries, sorting failures into per-GPU ``unsupported`` names and node ``errors``."""

    def __init__(self) -> None:
        self.errors: list[dict[str, Any]] = []

    def error(self, gpu: int | None, query: str, exc: Exception) -> None:
        self.errors.append({"gpu": gpu, "query": query, "error": str(exc)})

    def ask(self, gpu: int | None, unsupported: list[str] | None, field: str,
            query: str | Callable[..., Any], *args: Any) -> Any:
        """Call ``query`` (a pynvml function name or a helper); ``None`` when it has no answer.

        With ``unsupported`` None, NOT_SUPPORTED counts as an error (identity queries must answer).
        """
        name = query if isinstance(query, str) else query.__name__
        fn = getattr(nvml, name, None) if isinstance(query, str) else query
        try:
            if fn is None:
                raise nvml.NVMLError(_FUNCTION_NOT_FOUND)
            return fn(*args)
        except nvml.NVMLError as exc:
            if unsupported is not None and exc.value in _ABSENT:
                if field not in unsupported:
                    unsupported.append(field)
            else:
                self.error(gpu, name, exc)
        except Exception as exc:  # noqa: BLE001 - e.g. an nvidia-ml-py too old for a query: note it, keep probing
            self.error(gpu, name, RuntimeError(f"{type(exc).__name__}: {exc}"))
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _norm_bus(bus_id: str) -> str:
    """NVML reports bus ids with 8 or 4 domain digits and either case."""
    domain, _, rest = bus_id.lower().partition(":")
    try:
        return f"{int(domain, 16):08x}:{rest}" if rest else bus_id.lower()
    except ValueError:
        return bus_id.lower()


def _set_bits(words: Any) -> list[int]:
    """Bit numbers set in an array of 64-bit mask words, lowest first."""
    return [w * 64 + b for w, word in enumerate(words) for b in range(64) if int(word) >> b & 1]


def _ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the cpulist format of sysfs)."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def _clock_events(mask: int) -> dict[str, Any]:
    """The mask with its set bits named (unknown bits as ``bit_<n>``)."""
    names = [CLOCK_EVENT_REASONS.get(1 << b, f"bit_{b}") for b in range(64) if mask >> b & 1]
    return {"mask": mask, "active": names}


def clock_event_reasons(handle: Any) -> int:
    """The clock event (throttle) reason mask, through the older name on drivers before 535."""
    try:
        return int(nvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
    except (AttributeError, nvml.NVMLError_FunctionNotFound):
        return int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))


def gpu_fabric_info(handle: Any) -> Any:
    """The fabric info structure from the newest of nvmlDeviceGetGpuFabricInfoV (v3, v2) and
    nvmlDeviceGetGpuFabricInfo that this driver and pynvml both have."""
    attempts = [("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfo_v3_t"),
                ("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfo_v2_t"),
                ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t")]
    last: Exception = nvml.NVMLError(_FUNCTION_NOT_FOUND)
    for fn_name, struct_name in attempts:
        fn, struct = getattr(nvml, fn_name, None), getattr(nvml, struct_name, None)
        if fn is None or struct is None:
            continue
        info = struct()
        try:
            fn(handle, ctypes.byref(info))
            return info
        except nvml.NVMLError as exc:
            if exc.value not in (_FUNCTION_NOT_FOUND, _ARGUMENT_VERSION_MISMATCH):
                raise
            last = exc
    raise last


def _fabric(q: _Queries, index: int, unsupported: list[str], handle: Any) -> dict[str, Any] | None:
    info = q.ask(index, unsupported, "fabric", gpu_fabric_info, handle)
    if info is None:
        return None
    state = FABRIC_STATES.get(int(info.state))
    if state is None:
        q.error(index, "gpu_fabric_info", ValueError(f"unknown fabric state {int(info.state)}"))
        return None
    if state != "completed":  # status, clique and cluster are set by the registration
        return {"state": state, "status": None, "clique_id": None, "cluster_uuid": None}
    status = "success" if int(info.status) == 0 else str(nvml.NVMLError(int(info.status)))
    return {"state": state, "status": status, "clique_id": int(info.cliqueId),
            "cluster_uuid": str(uuid.UUID(bytes=bytes(info.clusterUuid)))}


def _nvlinks(q: _Queries, index: int, unsupported: list[str], handle: Any) -> list[dict[str, Any]] | None:
    links = []
    for link in range(max(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18), 18)):
        try:
            active = nvml.nvmlDeviceGetNvLinkState(handle, link) == 1
        except nvml.NVMLError as exc:
            if exc.value not in (*_ABSENT, _INVALID_ARGUMENT):  # a link this GPU lacks
                q.error(index, f"nvmlDeviceGetNvLinkState(link {link})", exc)
            continue
        try:
            remote_bus: str | None = _text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
        except nvml.NVMLError:
            remote_bus = None
        try:
            remote_type = REMOTE_DEVICE_TYPES.get(nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link), "unknown")
        except nvml.NVMLError:
            remote_type = None
        links.append({"link": link, "active": active, "remote_pci_bus_id": remote_bus,
                      "remote_device_type": remote_type})
    if not links:
        unsupported.append("nvlinks")
        return None
    return links


def _describe_gpu(q: _Queries, index: int, handle: Any) -> dict[str, Any] | None:
    """One GPU's facts; ``None`` (with the reason in ``q.errors``) when its identity cannot be read."""
    unsupported: list[str] = []

    def ask(field: str, query: str | Callable[..., Any], *args: Any) -> Any:
        return q.ask(index, unsupported, field, query, handle, *args)

    identity = [q.ask(index, None, field, name, handle) for field, name in (
        ("uuid", "nvmlDeviceGetUUID"), ("name", "nvmlDeviceGetName"),
        ("pci_bus_id", "nvmlDeviceGetPciInfo"), ("memory_total_bytes", "nvmlDeviceGetMemoryInfo"))]
    if any(v is None for v in identity):
        return None
    gpu_uuid, name, pci, memory = identity

    cc = ask("compute_capability", "nvmlDeviceGetCudaComputeCapability")
    persistence = ask("persistence_mode", "nvmlDeviceGetPersistenceMode")
    mig = ask("mig", "nvmlDeviceGetMigMode")
    ecc_mode = ask("ecc", "nvmlDeviceGetEccMode")
    ecc = None
    if ecc_mode is not None:
        counts = [ask("ecc_errors", "nvmlDeviceGetTotalEccErrors", _UNCORRECTED, counter)
                  for counter in (_VOLATILE, _AGGREGATE)]
        ecc = {"current": ecc_mode[0] == 1, "pending": ecc_mode[1] == 1,
               "uncorrected_volatile": counts[0], "uncorrected_aggregate": counts[1]}
    rows = ask("remapped_rows", "nvmlDeviceGetRemappedRows")
    pcie_values = [ask("pcie", name) for name in (
        "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkGeneration",
        "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetMaxPcieLinkWidth")]
    reasons = ask("clock_event_reasons", clock_event_reasons)
    numa_words = ask("numa_node", "nvmlDeviceGetMemoryAffinity", _NODE_SET_WORDS, _AFFINITY_SCOPE_NODE)
    numa_nodes = _set_bits(numa_words) if numa_words is not None else []
    cpu_words = ask("cpu_affinity", "nvmlDeviceGetCpuAffinity",
                    max(_MIN_CPU_SET_WORDS, (os.cpu_count() or 1) // 64 + 1))
    cpus = _set_bits(cpu_words) if cpu_words is not None else []
    for field, value, known in (("numa_node", numa_nodes, numa_words), ("cpu_affinity", cpus, cpu_words)):
        if known is not None and not value and field not in unsupported:  # an empty mask says nothing
            unsupported.append(field)

    gpu: dict[str, Any] = {
        "index": index,
        "uuid": _text(gpu_uuid),
        "name": _text(name),
        "pci_bus_id": _text(pci.busId),
        "memory_total_bytes": int(memory.total),
        "compute_capability": f"{cc[0]}.{cc[1]}" if cc is not None else None,
        "persistence_mode": persistence == 1 if persistence is not None else None,
        "mig": {"current": mig[0] == 1, "pending": mig[1] == 1} if mig is not None else None,
        "ecc": ecc,
        "remapped_rows": {"correctable": int(rows[0]), "uncorrectable": int(rows[1]),
                          "pending": bool(rows[2]), "failure": bool(rows[3])} if rows is not None else None,
        "pcie": None if None in pcie_values else dict(zip(
            ("gen_current", "gen_max", "width_current", "width_max"), (int(v) for v in pcie_values))),
        "clock_event_reasons": _clock_events(int(reasons)) if reasons is not None else None,
        "numa_node": numa_nodes[0] if numa_nodes else None,
        "cpu_affinity": _ranges(cpus) if cpus else None,
        "nvlinks": _nvlinks(q, index, unsupported, handle),
        "fabric": _fabric(q, index, unsupported, handle),
    }
    gpu["unsupported"] = sorted(set(unsupported))
    return gpu


def _active_switch_links(gpu: dict[str, Any]) -> int:
    """Active links to NVSwitches, or 0 when the GPU's fabric registration has not succeeded."""
    fabric = gpu.get("fabric")
    if fabric is not None and not (fabric["state"] == "not_supported" or (
            fabric["state"] == "completed" and fabric.get("status") in (None, "success"))):
        return 0
    return sum(1 for link in gpu.get("nvlinks") or [] if link["active"] and link["remote_device_type"] == "switch")


def _direct_links(a: dict[str, Any], b: dict[str, Any]) -> int:
    target = _norm_bus(b["pci_bus_id"])
    return sum(1 for link in a.get("nvlinks") or [] if link["active"] and link["remote_device_type"] == "gpu"
               and link["remote_pci_bus_id"] and _norm_bus(link["remote_pci_bus_id"]) == target)


def nvlink_label(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """``NV<n>`` when GPUs ``a`` and ``b`` (facts dicts) reach each other over NVLink, else ``None``.

    Direct links count per pair (the larger of the two ends' counts); GPUs on a switch fabric in the
    same clique get the smaller of their active switch link counts.
    """
    direct = max(_direct_links(a, b), _direct_links(b, a))
    if direct:
        return f"NV{direct}"
    via_switch = min(_active_switch_links(a), _active_switch_links(b))
    cliques = {(g.get("fabric") or {}).get("clique_id") for g in (a, b)} - {None}
    return f"NV{via_switch}" if via_switch and len(cliques) <= 1 else None


def _topology(q: _Queries, handles: list[Any], gpus: list[dict[str, Any]]) -> list[list[str]]:
    n = len(gpus)
    matrix = [["X"] * n for _ in range(n)]
    for a in range(n):
        for b in range(a + 1, n):
            label = nvlink_label(gpus[a], gpus[b])
            if label is None:
                level = q.ask(gpus[a]["index"], [], "topology", "nvmlDeviceGetTopologyCommonAncestor",
                              handles[a], handles[b])
                label = TOPOLOGY_LABELS.get(level, "N/A") if level is not None else "N/A"
            matrix[a][b] = matrix[b][a] = label
    return matrix


def _no_nvml(reason: str) -> dict[str, Any]:
    return {"schema": SCHEMA, "hostname": socket.gethostname(),
            "nvml": {"available": False, "error": f"{NO_NVML}: {reason}"}, "gpus": [], "topology": []}


def probe() -> dict[str, Any]:
    """The facts document for this node (a plain dict, ready for ``json.dumps``)."""
    if nvml is None:
        return _no_nvml(f"python module pynvml (nvidia-ml-py) is not installed for {sys.executable}")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        hint = " (libnvidia-ml.so.1 not loadable: is the NVIDIA driver installed?)" \
            if exc.value == _LIBRARY_NOT_FOUND else ""
        return _no_nvml(f"nvmlInit: {exc}{hint}")
    try:
        q = _Queries()
        doc: dict[str, Any] = {
            "schema": SCHEMA,
            "hostname": socket.gethostname(),
            "nvml": {"available": True, "error": None},
            "driver_version": q.ask(None, None, "driver_version", "nvmlSystemGetDriverVersion"),
            "cuda_driver_version": None,
            "nvml_version": q.ask(None, None, "nvml_version", "nvmlSystemGetNVMLVersion"),
        }
        cuda = q.ask(None, None, "cuda_driver_version", "nvmlSystemGetCudaDriverVersion")
        if cuda is not None:
            doc["cuda_driver_version"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
        count = q.ask(None, None, "gpus", "nvmlDeviceGetCount") or 0
        handles, gpus = [], []
        for index in range(count):
            handle = q.ask(index, None, "gpus", "nvmlDeviceGetHandleByIndex", index)
            gpu = _describe_gpu(q, index, handle) if handle is not None else None
            if gpu is not None:
                handles.append(handle)
                gpus.append(gpu)
        doc["gpus"] = gpus
        doc["topology"] = _topology(q, handles, gpus)
        doc["errors"] = q.errors
        return doc
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()


def _load_sibling(name: str) -> ModuleType:
    """Import ``<name>.py`` from this file's directory (node code has no package to import from)."""
    path = Path(__file__).resolve().with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"gpufleet_node_{name}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nvml_probe.py", description="Probe NVIDIA GPUs through NVML.")
    parser.add_argument("--compact", action="store_true", help="print the facts on one line")
    parser.add_argument("--gate", metavar="POLICY.json",
                        help="judge the facts against this health policy: exit 0 pass, 1 fail, 2 bad policy")
    parser.add_argument("--json", action="store_true", help="with --gate: print the verdict as JSON")
    args = parser.parse_args(argv)
    if args.gate is None:
        print(json.dumps(probe(), indent=None if args.compact else 2))
        return 0
    rules = _load_sibling("health_rules")
    try:
        policy = rules.load_policy(Path(args.gate))
    except rules.PolicyError as exc:
        print(f"gpu gate: {exc}", file=sys.stderr)
        return 2
    facts = probe()
    failures = rules.evaluate(facts, policy)
    verdict = rules.verdict(facts, failures)
    print(json.dumps(verdict, indent=2) if args.json else rules.format_verdict(verdict))
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
