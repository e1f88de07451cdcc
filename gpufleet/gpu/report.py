"""The node GPU facts document: what the NVML probe prints and what the planner and health gate read.

One JSON document per node. Example (abridged)::

    {
      "schema": "gpufleet.gpu-facts/1",
      "hostname": "gpu-a01",
      "nvml": {"available": true, "error": null},
      "driver_version": "580.95.05",
      "cuda_driver_version": "13.0",
      "nvml_version": "13.580.95.05",
      "gpus": [
        {"index": 0, "uuid": "GPU-…", "name": "NVIDIA H100 80GB HBM3",
         "pci_bus_id": "00000000:18:00.0", "memory_total_bytes": 85520809984,
         "compute_capability": "9.0", "persistence_mode": true,
         "mig": {"current": false, "pending": false},
         "ecc": {"current": true, "pending": true,
                 "uncorrected_volatile": 0, "uncorrected_aggregate": 0},
         "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": false, "failure": false},
         "pcie": {"gen_current": 5, "gen_max": 5, "width_current": 16, "width_max": 16},
         "clock_event_reasons": {"mask": 1, "active": ["gpu_idle"]},
         "numa_node": 0, "cpu_affinity": "0-55",
         "nvlinks": [{"link": 0, "active": true, "remote_pci_bus_id": "00000000:05:00.0",
                      "remote_device_type": "switch"}],
         "fabric": {"state": "completed", "status": "success", "clique_id": 1, "cluster_uuid": "…"},
         "unsupported": []}
      ],
      "topology": [["X", "NV18"], ["NV18", "X"]]
    }

A query the GPU does not support leaves its field ``null`` and its name in ``unsupported``.
``nvml.available`` is false (and ``gpus`` empty) on a node without a usable NVIDIA driver.
A query that fails for another reason (``GPU is lost``, ``Unknown Error``) leaves its field ``null``
and adds an entry to ``errors`` (``{"gpu": 3, "query": "nvmlDeviceGetHandleByIndex", "error": "GPU is
lost"}``); a GPU whose identity cannot be read is left out of ``gpus`` and named there.
The topology matrix uses the labels of ``nvidia-smi topo -m``: ``X`` (self), ``NV<n>`` (n direct
NVLinks, or NVSwitch fabric), ``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpufleet.input_files import InputFileError, json_depth_problem, read_regular

SCHEMA = "gpufleet.gpu-facts/1"

RemoteDeviceType = Literal["gpu", "switch", "ibmnpu", "unknown"]
FabricState = Literal["not_supported", "not_started", "in_progress", "completed"]


class _Facts(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NvmlStatus(_Facts):
    available: bool
    error: str | None = None


class Mig(_Facts):
    current: bool
    pending: bool


class Ecc(_Facts):
    current: bool
    pending: bool
    uncorrected_volatile: int | None = None
    uncorrected_aggregate: int | None = None


class RemappedRows(_Facts):
    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


class Pcie(_Facts):
    gen_current: int
    gen_max: int
    width_current: int
    width_max: int


class ClockEventReasons(_Facts):
    mask: int
    active: list[str]


class NvLink(_Facts):
    link: int
    active: bool
    remote_pci_bus_id: str | None = None
    remote_device_type: RemoteDeviceType | None = None


class Fabric(_Facts):
    state: FabricState
    status: str | None = None
    clique_id: int | None = None
    cluster_uuid: str | None = None


class QueryError(_Facts):
    """An NVML query that failed with something other than NOT_SUPPORTED."""

    gpu: int | None = None
    query: str
    error: str


class Gpu(_Facts):
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    memory_total_bytes: int
    compute_capability: str | None = None
    persistence_mode: bool | None = None
    mig: Mig | None = None
    ecc: Ecc | None = None
    remapped_rows: RemappedRows | None = None
    pcie: Pcie | None = None
    clock_event_reasons: ClockEventReasons | None = None
    numa_node: int | None = None
    cpu_affinity: str | None = None
    nvlinks: list[NvLink] | None = None
    fabric: Fabric | None = None
    unsupported: list[str] = []


class NodeFacts(_Facts):
    schema_: str = Field(SCHEMA, alias="schema")
    hostname: str
    nvml: NvmlStatus
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    nvml_version: str | None = None
    gpus: list[Gpu] = []
    topology: list[list[str]] = []
    errors: list[QueryError] = []

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    def to_json(self) -> str:
        """Serialise as the facts document."""
        return json.dumps(self.model_dump(mode="json", by_alias=True), indent=2) + "\n"


class FactsError(Exception):
    """A facts document that cannot be read; the message names the file."""


def parse_facts(doc: dict[str, object], source: str = "<facts>") -> NodeFacts:
    """Validate a facts document (a parsed JSON object)."""
    if doc.get("schema") != SCHEMA:
        raise FactsError(f"{source}: schema: expected {SCHEMA!r}, found {doc.get('schema')!r}")
    try:
        return NodeFacts.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise FactsError(f"{source}: {loc}: {first['msg']}") from None


def load_facts(path: Path) -> NodeFacts:
    """Read one node's facts JSON file."""
    try:
        text = read_regular(path, "a facts file").decode("utf-8")
        if problem := json_depth_problem(text):
            raise FactsError(f"{path}: {problem}")
        doc = json.loads(text)
    except InputFileError as exc:
        raise FactsError(f"{path}: {exc.message}") from None
    except UnicodeDecodeError as exc:
        raise FactsError(f"{path}: expected UTF-8 text, found byte 0x{exc.object[exc.start]:02x}") from None
    except json.JSONDecodeError as exc:
        raise FactsError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    if not isinstance(doc, dict):
        raise FactsError(f"{path}: expected a JSON object, found {type(doc).__name__}")
    return parse_facts(doc, str(path))
