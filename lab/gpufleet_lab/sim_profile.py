"""Profiles for the NVML simulator (a LAB DOUBLE): declared hardware, injected faults, the profile file.

A profile file describes one simulated node in the line format that ``nvml_sim.c`` reads. It is
written from a facts document, so what the simulator answers is, by construction, what the probe
should report: ``write_sim_profile(path, "8xH100-SXM", ["link_down"])`` returns the facts the probe
must print on that node.

Faults turn a healthy node's facts into a faulty one's; each takes a GPU index (default 0):

- ``link_down``: the GPU's last active NVLink goes inactive (and its peer's end, on bridged pairs);
- ``fabric_in_progress``: NVSwitch fabric registration not finished (GPUs with fabric info only);
- ``pending_row_remap``: a row remapped after a correctable error, waiting for a GPU reset;
- ``pcie_x8``: the PCIe link trained at x8 instead of x16;
- ``persistence_off``: persistence mode disabled;
- ``gpu_missing``: the GPU fell off the bus before the driver loaded, so NVML enumerates one GPU
  fewer and renumbers the rest;
- ``gpu_lost``: the GPU fell off the bus at run time (Xid 79): still counted, but its handle
  answers ``GPU is lost`` (dcgm-exporter stops reporting it: one GPU fewer in its metrics).

Two more faults leave the facts alone (the probe does not read them) and show in what monitoring reads
through dcgm-exporter; a third element of the fault, after the GPU, gives their value:

- ``xid``: the GPU reports an XID, e.g. ``("xid", 2, 79)`` (the XID is required); the profile keeps the
  GPU's XID history, and the simulator delivers the XIDs new to it as NVML XID events;
- ``nvlink_errors``: each NVLink error counter (CRC flit, CRC data, replay, recovery) of each of the GPU's
  active links counts ``NVLINK_ERRORS``, or the value given, e.g. ``("nvlink_errors", 1, 500)``;
- ``dcgm_fail``, ``dcgm_warn``, ``dcgm_skip``: what the lab's ``dcgmi`` double reports for the GPU's memory test
  (``double_programs/dcgmi.py``): failed or warned with the ``DCGM_FR`` error code given, e.g.
  ``("dcgm_fail", 3, 50)``, or skipped.

On a running node the simulator picks up a profile replaced at run time (write it beside, rename it over
the old one; ``write_sim_profile`` does so): ``write_sim_profile(path, "8xH100-SXM", [("xid", 2, 79)])``
raises the fault, ``write_sim_profile(path, "8xH100-SXM")`` clears it (an XID, once delivered, stays in
dcgm-exporter's count until its window passes).

The simulator cannot know the PCIe path behind an ``NV<n>`` cell of a facts topology; it takes
``NODE`` for GPUs on the same NUMA node and ``SYS`` otherwise, as the declared profiles do.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.gpu.profiles import profile_facts
from gpufleet.gpu.report import NodeFacts, parse_facts
from gpufleet.node.nvml_probe import nvlink_label

Doc = dict[str, Any]
Fault = str | tuple[str, int] | tuple[str, int, int]
LOST_QUERY = "nvmlDeviceGetHandleByIndex"
NVLINK_ERRORS = 10  # per counter and active link, for an nvlink_errors fault without a value
_PCIE_LABELS = ("PIX", "PXB", "PHB", "NODE", "SYS")


class FaultError(ValueError):
    """A fault that does not apply to the node (no NVLink to take down, no GPU of that index)."""


def _gpu(doc: Doc, index: int) -> Doc:
    gpus: list[Doc] = doc["gpus"]
    for gpu in gpus:
        if gpu["index"] == index:
            return gpu
    raise FaultError(f"no GPU {index} on {doc['hostname']} (GPUs: {[g['index'] for g in doc['gpus']]})")


def _pcie_paths(doc: Doc) -> dict[tuple[str, str], str]:
    """The PCIe label between each pair of GPUs (by UUID), ``NV<n>`` cells taken from NUMA nodes."""
    gpus, paths = doc["gpus"], {}
    # Facts from elsewhere may carry a short or empty topology: pairs it does not cover get no label.
    for a, row in zip(gpus, doc["topology"], strict=False):
        for b, label in zip(gpus, row, strict=False):
            if a is not b:
                same_node = a["numa_node"] == b["numa_node"]
                paths[a["uuid"], b["uuid"]] = label if label in _PCIE_LABELS else ("NODE" if same_node else "SYS")
    return paths


def _relabel(doc: Doc, paths: dict[tuple[str, str], str]) -> None:
    """Recompute the topology matrix from the GPUs' NVLinks and the PCIe paths."""
    gpus = doc["gpus"]
    doc["topology"] = [["X" if a is b else nvlink_label(a, b) or paths[a["uuid"], b["uuid"]] for b in gpus]
                       for a in gpus]


def _drop_links_to(doc: Doc, bus_id: str) -> None:
    for gpu in doc["gpus"]:
        for link in gpu["nvlinks"] or []:
            if link["remote_device_type"] == "gpu" and (link["remote_pci_bus_id"] or "").lower() == bus_id.lower():
                link["active"] = False


def _link_down(doc: Doc, index: int) -> None:
    gpu = _gpu(doc, index)
    active = [link for link in gpu["nvlinks"] or [] if link["active"]]
    if not active:
        raise FaultError(f"link_down: GPU {index} has no active NVLink")
    link = active[-1]
    link["active"] = False
    if link["remote_device_type"] == "gpu":  # a bridge link is down at both ends
        for peer in doc["gpus"]:
            if (peer["pci_bus_id"].lower() == (link["remote_pci_bus_id"] or "").lower()):
                for peer_link in peer["nvlinks"] or []:
                    if peer_link["link"] == link["link"]:
                        peer_link["active"] = False


def _fabric_in_progress(doc: Doc, index: int) -> None:
    gpu = _gpu(doc, index)
    if gpu["fabric"] is None:
        raise FaultError(f"fabric_in_progress: GPU {index} ({gpu['name']}) reports no fabric info")
    gpu["fabric"] = {"state": "in_progress", "status": None, "clique_id": None, "cluster_uuid": None}


def _pending_row_remap(doc: Doc, index: int) -> None:
    gpu = _gpu(doc, index)
    if gpu["remapped_rows"] is None:
        raise FaultError(f"pending_row_remap: GPU {index} ({gpu['name']}) has no row remapping")
    gpu["remapped_rows"]["correctable"] += 1
    gpu["remapped_rows"]["pending"] = True


def _pcie_x8(doc: Doc, index: int) -> None:
    gpu = _gpu(doc, index)
    if gpu["pcie"] is None or gpu["pcie"]["width_max"] <= 8:
        raise FaultError(f"pcie_x8: GPU {index} has no PCIe link wider than x8")
    gpu["pcie"]["width_current"] = 8


def _persistence_off(doc: Doc, index: int) -> None:
    _gpu(doc, index)["persistence_mode"] = False


def _gpu_missing(doc: Doc, index: int) -> None:
    gone = _gpu(doc, index)
    doc["gpus"].remove(gone)
    _drop_links_to(doc, gone["pci_bus_id"])
    for position, gpu in enumerate(doc["gpus"]):
        gpu["index"] = position


def _gpu_lost(doc: Doc, index: int) -> None:
    gone = _gpu(doc, index)
    doc["gpus"].remove(gone)
    _drop_links_to(doc, gone["pci_bus_id"])
    doc["errors"].append({"gpu": index, "query": LOST_QUERY, "error": "GPU is lost"})


FAULTS: dict[str, Callable[[Doc, int], None]] = {
    "link_down": _link_down,
    "fabric_in_progress": _fabric_in_progress,
    "pending_row_remap": _pending_row_remap,
    "pcie_x8": _pcie_x8,
    "persistence_off": _persistence_off,
    "gpu_missing": _gpu_missing,
    "gpu_lost": _gpu_lost,
}


@dataclass
class GpuCounters:
    """What faults left in a GPU's counters and XID history: what only monitoring reads (no facts)."""

    xids: list[int] = field(default_factory=list)
    nvlink_errors: dict[int, int] = field(default_factory=dict)  # link -> errors in each of its four counters
    dcgm: tuple[str, int] | None = None  # what the dcgmi double reports for the GPU: (fail|skip|warn, code)


def _xid(gpu: Doc, counters: GpuCounters, xid: int | None) -> None:
    if xid is None or not 0 < xid < 1000:
        raise FaultError(f"xid: give the XID (1-999) after the GPU, e.g. ('xid', {gpu['index']}, 79); got {xid}")
    counters.xids.append(xid)


def _nvlink_errors(gpu: Doc, counters: GpuCounters, errors: int | None) -> None:
    active = [link["link"] for link in gpu["nvlinks"] or [] if link["active"]]
    if not active:
        raise FaultError(f"nvlink_errors: GPU {gpu['index']} has no active NVLink")
    count = NVLINK_ERRORS if errors is None else errors
    if count <= 0:
        raise FaultError(f"nvlink_errors: the error count must be positive, got {count}")
    for link in active:
        counters.nvlink_errors[link] = counters.nvlink_errors.get(link, 0) + count


def _dcgm(kind: str) -> Callable[[Doc, GpuCounters, int | None], None]:
    def fault(gpu: Doc, counters: GpuCounters, code: int | None) -> None:
        if kind != "skip" and (code is None or code <= 0):
            raise FaultError(f"dcgm_{kind}: give the DCGM_FR error code after the GPU, e.g. ('dcgm_{kind}',"
                             f" {gpu['index']}, 50); got {code}")
        counters.dcgm = (kind, code or 0)

    return fault


COUNTER_FAULTS: dict[str, Callable[[Doc, GpuCounters, int | None], None]] = {
    "xid": _xid,
    "nvlink_errors": _nvlink_errors,
    "dcgm_fail": _dcgm("fail"),
    "dcgm_skip": _dcgm("skip"),
    "dcgm_warn": _dcgm("warn"),
}


def apply_fault(facts: NodeFacts, fault: str, gpu: int = 0) -> NodeFacts:
    """The facts the node reports once ``fault`` hits GPU ``gpu``."""
    if fault in COUNTER_FAULTS:
        raise FaultError(f"{fault} leaves the facts alone: raise it with write_sim_profile")
    if fault not in FAULTS:
        raise FaultError(f"unknown fault {fault!r}; known: {', '.join([*FAULTS, *COUNTER_FAULTS])}")
    doc = facts.model_dump(mode="json", by_alias=True)
    paths = _pcie_paths(doc)
    FAULTS[fault](doc, gpu)
    _relabel(doc, paths)
    return parse_facts(doc, f"{facts.hostname} with {fault} on GPU {gpu}")


def _cuda_number(version: str) -> int:
    major, _, minor = version.partition(".")
    return int(major) * 1000 + int(minor or 0) * 10


def _gpu_lines(gpu: Doc, row: list[str], counters: GpuCounters) -> list[str]:
    unsupported = set(gpu["unsupported"])
    unsupported.update(field for field in ("compute_capability", "persistence_mode", "mig", "ecc", "remapped_rows",
                                           "pcie", "clock_event_reasons", "numa_node", "cpu_affinity", "nvlinks",
                                           "fabric") if gpu[field] is None)
    lines = [f"gpu {gpu['index']}", f"uuid {gpu['uuid']}", f"name {gpu['name']}", f"pci_bus_id {gpu['pci_bus_id']}",
             f"memory_total {gpu['memory_total_bytes']}"]
    if gpu["compute_capability"] is not None:
        lines.append("compute_capability " + " ".join(gpu["compute_capability"].split(".", 1)))
    if gpu["persistence_mode"] is not None:
        lines.append(f"persistence_mode {int(gpu['persistence_mode'])}")
    if gpu["mig"] is not None:
        lines.append(f"mig {int(gpu['mig']['current'])} {int(gpu['mig']['pending'])}")
    if (ecc := gpu["ecc"]) is not None:
        lines.append(f"ecc {int(ecc['current'])} {int(ecc['pending'])}")
        if ecc["uncorrected_volatile"] is None or ecc["uncorrected_aggregate"] is None:
            unsupported.add("ecc_errors")
        else:
            lines.append(f"ecc_uncorrected {ecc['uncorrected_volatile']} {ecc['uncorrected_aggregate']}")
    if (rows := gpu["remapped_rows"]) is not None:
        lines.append(f"remapped_rows {rows['correctable']} {rows['uncorrectable']} {int(rows['pending'])} "
                     f"{int(rows['failure'])}")
    if (pcie := gpu["pcie"]) is not None:
        lines.append(f"pcie {pcie['gen_current']} {pcie['gen_max']} {pcie['width_current']} {pcie['width_max']}")
    if gpu["clock_event_reasons"] is not None:
        lines.append(f"clock_event_reasons {gpu['clock_event_reasons']['mask']}")
    if gpu["numa_node"] is not None:
        lines.append(f"numa_node {gpu['numa_node']}")
    if gpu["cpu_affinity"] is not None:
        lines.append(f"cpu_affinity {gpu['cpu_affinity']}")
    for link in gpu["nvlinks"] or []:
        lines.append(f"nvlink {link['link']} {int(link['active'])} {link['remote_device_type'] or '-'} "
                     f"{link['remote_pci_bus_id'] or '-'}")
    for link, errors in sorted(counters.nvlink_errors.items()):  # CRC flit, CRC data, replay, recovery
        lines.append(f"nvlink_errors {link} {errors} {errors} {errors} {errors}")
    if counters.xids:
        lines.append("xids " + " ".join(str(xid) for xid in counters.xids))
    if counters.dcgm is not None:
        lines.append(f"dcgm {counters.dcgm[0]} {counters.dcgm[1]}")
    if (fabric := gpu["fabric"]) is not None:
        if fabric["state"] == "completed":
            lines.append(f"fabric completed {fabric['status'] or 'success'} {fabric['clique_id'] or 0} "
                         f"{fabric['cluster_uuid'] or '00000000-0000-0000-0000-000000000000'}")
        else:
            lines.append(f"fabric {fabric['state']}")
    lines.append("topology " + " ".join(row))
    if unsupported:
        lines.append("unsupported " + " ".join(sorted(unsupported)))
    return lines


def sim_profile_text(facts: NodeFacts, counters: Mapping[str, GpuCounters] | None = None) -> str:
    """The simulator profile that makes NVML answer with these facts and these counters (by GPU UUID)."""
    if not facts.nvml.available:
        raise ValueError(f"{facts.hostname}: a node without NVML has no simulator profile (leave the file out)")
    doc = facts.model_dump(mode="json", by_alias=True)
    if not all(doc[k] for k in ("driver_version", "nvml_version", "cuda_driver_version")):
        raise ValueError(f"{facts.hostname}: driver, NVML and CUDA versions are needed for a simulator profile")
    lost = sorted(e["gpu"] for e in doc["errors"] if e["query"] == LOST_QUERY and e["gpu"] is not None)
    count = len(doc["gpus"]) + len(lost)
    paths = _pcie_paths(doc)
    by_index = {g["index"]: g for g in doc["gpus"]}
    lines = ["# NVML simulator profile: a LAB DOUBLE of a GPU node, not real hardware.",
             f"# Written by gpufleet_lab.sim_profile for host {facts.hostname}.",
             f"driver_version {doc['driver_version']}", f"nvml_version {doc['nvml_version']}",
             f"cuda_driver_version {_cuda_number(doc['cuda_driver_version'])}", f"device_count {count}"]
    for index in range(count):
        gpu = by_index.get(index)
        if gpu is None:
            if index not in lost:
                raise ValueError(f"{facts.hostname}: GPU indices must run 0..{count - 1}; {index} is absent")
            lines += [f"gpu {index}", "lost"]
            continue
        row = ["X" if j == index else paths[gpu["uuid"], by_index[j]["uuid"]] if j in by_index else "SYS"
               for j in range(count)]
        lines += _gpu_lines(gpu, row, (counters or {}).get(gpu["uuid"], GpuCounters()))
    return "\n".join(lines) + "\n"


def write_sim_profile(path: Path, profile_name: str, faults: Iterable[Fault] = (),
                      hostname: str | None = None) -> NodeFacts:
    """Write the simulator profile of a declared hardware profile with faults applied in order.

    ``faults`` holds fault names (GPU 0), ``(name, gpu)`` pairs or ``(name, gpu, value)`` for the faults
    that take a value (``xid``, ``nvlink_errors``). The file is replaced atomically, so a running
    simulator reads the old profile or the new one. Returns the facts the probe should report on that
    node; ``hostname`` defaults to this machine's, which the probe reports.
    """
    facts = profile_facts(profile_name, hostname or socket.gethostname())
    counters: dict[str, GpuCounters] = {}
    for fault in faults:
        name, gpu, value = (fault, 0, None) if isinstance(fault, str) else (*fault, None)[:3]
        if name in COUNTER_FAULTS:
            target = _gpu(facts.model_dump(mode="json", by_alias=True), gpu)
            COUNTER_FAULTS[name](target, counters.setdefault(target["uuid"], GpuCounters()), value)
            continue
        if value is not None:
            raise FaultError(f"{name} takes no value after the GPU, got {value}")
        facts = apply_fault(facts, name, gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.new")
    staged.write_text(sim_profile_text(facts, counters))
    os.replace(staged, path)
    return facts
