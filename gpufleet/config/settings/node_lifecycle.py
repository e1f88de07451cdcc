"""The node lifecycle's settings: burn-in, findings, quarantine and readmission.

Each field is one variable's record (:mod:`gpufleet.config.settings`); ``roles/node_lifecycle/defaults.yml`` is
written from them.
"""

from __future__ import annotations

import math
import re
from functools import cache
from importlib.resources import files
from typing import Any, Literal

import yaml
from pydantic import ValidationInfo, field_validator

from gpufleet.config.settings import RoleSettings, setting
from gpufleet.node.findings import catalog_problems
from gpufleet.values import grammar
from gpufleet.values.problems import KeyedError
from gpufleet.values.types import Port

CATALOG = "data/findings.yml"
KMSG = "/dev/kmsg"
_LOG_PATH = re.compile(r"/[A-Za-z0-9._+/-]{1,1023}")


@cache
def repository_catalog() -> dict[str, Any]:
    """The findings catalog kept in the repository (gpufleet/data/findings.yml), which node_findings overrides."""
    doc: dict[str, Any] = yaml.safe_load(files("gpufleet").joinpath(CATALOG).read_text())
    return doc


def _shown(bound: float) -> str:
    return f"{bound:g}" if abs(bound) < 1e6 else f"{bound:.0f}"


def _positive(value: Any, low: float, high: float, what: str = "seconds") -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        shown = grammar.show(int(value) if isinstance(value, float) and value.is_integer() else value)
        raise ValueError(f"expected {what} from {_shown(low)} to {_shown(high)}, found {shown}")
    return value


# The bounds of each ranged variable: (low, high, what the line calls its value).
RANGES: dict[str, tuple[float, float, str]] = {
    "node_xid_burst_quiet_s": (1, 86400, "seconds"),
    "node_cool_off_s": (1, 86400, "seconds"),
    "node_drain_timeout_s": (1, 86400, "seconds"),
    "node_retire_window_s": (3600, 365 * 86400, "seconds"),
    "node_fabric_floor_gbps": (1e-6, 1e4, "GB/s"),
    "node_fabric_timeout_s": (5, 300, "seconds"),
    "node_readmit_passes": (1, 10, "a count"),
    "node_retire_after": (2, 20, "a count"),
    "burn_in_seconds": (0.5, 3600, "seconds"),
    "burn_in_matmul_n": (256, 32768, "a size"),
}


class NodeLifecycleSettings(RoleSettings):
    """A node earns its place: a new node passes the quick burn-in before a replica lands on it; a finding (an Xid
    from the kernel log, the GPU watch's failed gate) moves it as the findings catalog says; a quarantined node
    leaves every router first (HAProxy's agent check on node_agent_port), then stops, keeps its evidence and runs the
    full burn-in; clean passes after a growing cool-off bring it back, and repeated quarantines retire it.
    """

    node_lifecycle_enabled: bool = setting(
        True,
        "Keep a state per node (burn-in, quarantine, readmission) and run its watch; false turns it all off.",
    )
    node_agent_port: Port = setting(
        9311,
        "TCP port of the node watch's agent, which every router's HAProxy asks each second whether the node's"
        " replicas may take requests.",
    )
    node_kernel_log: str = setting(
        "/dev/kmsg",
        "Where the node watch reads the kernel log for Xids: /dev/kmsg, or a file the kernel's messages are"
        " appended to (an absolute path of letters, digits, '.', '_', '-', '+'; not in /proc, /sys, /dev or /etc).",
    )
    node_findings: dict[str, Any] = setting(
        {},
        "Entries that replace the findings catalog's (gpufleet/data/findings.yml): xid: {CODE: {action: ...}},"
        " checks: {NAME: {action: ...}} for a check the catalog lists; action quarantine, suspect or record, with an"
        " optional name and NVIDIA resolution bucket. Each Xid code once.",
    )
    node_xid_burst_quiet_s: float = setting(
        180,
        "Seconds without another line of the same Xid on the same GPU that close a burst (a burst counts once).",
    )
    node_readmit_passes: int = setting(
        2,
        "Clean full burn-in passes a quarantined node needs before it serves again (1 to 10).",
    )
    node_cool_off_s: float = setting(
        600,
        "Seconds a quarantined node rests before its readmission burn-in; doubled for each earlier quarantine in"
        " the retire window.",
    )
    node_retire_after: int = setting(
        3,
        "Quarantines within node_retire_window_s that retire the node, with a note for the vendor (2 to 20).",
    )
    node_retire_window_s: float = setting(
        7 * 86400,
        "The window, in seconds, in which node_retire_after quarantines retire a node.",
    )
    node_drain_timeout_s: float = setting(
        60,
        "Seconds a leaving node's replicas get to finish the requests they run, once no router sends them more.",
    )
    burn_in_device: Literal["cuda", "cpu"] = setting(
        "cuda",
        "Where the burn-in's kernels run: cuda (the GPUs), or cpu where the host's CPU stands in (a lab double).",
    )
    burn_in_floors: dict[str, float] = setting(
        {},
        "Floors that replace the GPU profile's: matmul_tflops, copy_gbps, allreduce_busbw_gbps (positive).",
    )
    burn_in_seconds: float = setting(
        10,
        "Seconds of matrix products per GPU in the quick burn-in (the copy runs a third of it).",
    )
    burn_in_matmul_n: int = setting(
        8192,
        "The size of the burn-in's square matrices (256 to 32768).",
    )

    node_fabric_check: bool = setting(
        True,
        "Before each generation of a multi-node replica starts (mp: its ranks; Ray: the head's join wait, once every"
        " node joined), check the fabric between its nodes: an all-reduce over exactly its nodes, on"
        " fleet_interface, that must finish within node_fabric_timeout_s and reach node_fabric_floor_gbps; a node"
        " that fails it is named and the replica does not start.",
        scope="pool",
    )
    node_fabric_port: Port = setting(
        29589,
        "Port on which rank 0 of a multi-node replica gathers the fabric check's ranks.",
        scope="pool",
    )
    node_fabric_floor_gbps: float = setting(
        1.0,
        "The fabric check's floor, in GB/s: each node's way out to the replica's first node, and the all-reduce's bus"
        " bandwidth (NCCL on GPUs; gloo on the CPU build).",
        scope="pool",
    )
    node_fabric_timeout_s: float = setting(
        20,
        "Seconds the fabric check waits for every rank to join, and for each transfer (5 to 300): a rank that stalls"
        " longer is named.",
        scope="pool",
    )

    @field_validator("node_kernel_log")
    @classmethod
    def _kernel_log(cls, value: str) -> str:
        """/dev/kmsg, or a log file: an absolute normalised path of plain characters (no shell, glob or systemd
        specifier), not in a kernel file system or /etc, each name within what a file system allows."""
        if value == KMSG:
            return value
        plain = _LOG_PATH.fullmatch(value) is not None and grammar.node_dir(value) is None
        names = value.split("/")[1:]
        kernel = ("/proc", "/sys", "/dev", "/etc", "/run/credentials")
        gpufleets = ("/var/lib/gpufleet", "/run/gpufleet", "/etc/gpufleet", "/opt/gpufleet")  # its own files
        if not plain or value.endswith("/") or any(len(name) > 255 for name in names) \
                or any(value == top or value.startswith(f"{top}/") for top in (*kernel, *gpufleets)):
            raise ValueError(f"expected {KMSG} or a log file's absolute path (letters, digits, '.', '_', '-', '+',"
                             f" '/', at most 1024 characters; not in /proc, /sys, /dev, /etc or gpufleet's own"
                             f" folders), found {grammar.show(value)}")
        return value

    @field_validator("node_findings")
    @classmethod
    def _findings(cls, value: dict[str, Any]) -> dict[str, Any]:
        problems = catalog_problems(value, "node_findings", frozenset(repository_catalog()["checks"]))
        problems += [f"node_findings.{part}.{key}.name: expected a finding's name, found text that looks like a"
                     " credential (not shown)" for part in ("xid", "checks")
                     for key, entry in (value.get(part) or {}).items() if isinstance(value.get(part), dict)
                     and isinstance(entry, dict) and isinstance(entry.get("name"), str)
                     and grammar.secret_like(entry["name"])]
        if problems:
            path, _, message = problems[0].partition(": ")
            key = path.removeprefix("node_findings").lstrip(".")
            raise KeyedError(key, message) if key else ValueError(message)
        return value

    @field_validator(*RANGES)
    @classmethod
    def _in_range(cls, value: float, info: ValidationInfo) -> float:
        """Each ranged variable within its bounds (:data:`RANGES`), as the type it is declared with."""
        low, high, what = RANGES[str(info.field_name)]
        found = _positive(value, low, high, what)
        return int(found) if what in ("a count", "a size") else float(found)

    @field_validator("burn_in_floors")
    @classmethod
    def _floors(cls, value: dict[str, float]) -> dict[str, float]:
        for key, floor in value.items():
            if key not in ("matmul_tflops", "copy_gbps", "allreduce_busbw_gbps"):
                raise ValueError("expected the floors matmul_tflops, copy_gbps, allreduce_busbw_gbps, found"
                                 f" {grammar.show(key)}")
            try:
                _positive(floor, 1e-6, 1e6, "a positive rate")
            except ValueError as bad:
                raise KeyedError(key, str(bad)) from None
        return value
