"""Declared hardware profiles: the GPU facts a node of a known shape would report.

A profile name reads ``<count>x<gpu>-<interconnect>`` (``8xH100-SXM``, ``8xL40S-PCIe``,
``4xA100-PCIe-pairs``) or ``<count>x<gpu>`` for the GPU's usual interconnect (``2xRTX4090``):

- ``SXM``: every GPU on an NVSwitch fabric (HGX/DGX boards);
- ``PCIe``: no NVLink; GPUs 0..n/2-1 on NUMA node 0, the rest on NUMA node 1;
- ``PCIe-pairs``: PCIe cards joined two by two with NVLink bridges.

Used offline by the planner (``gpu_profile`` in the fleet config) and by the lab, whose simulated
NVML answers from the same description.

A profile's facts carry the memory NVML reports (``nvidia-smi``'s total). The framework sees less: CUDA's
``cudaMemGetInfo`` total, which PyTorch reports and vLLM multiplies by ``--gpu-memory-utilization``, leaves out
what the driver reserves. `framework_memory_bytes` converts one to the other, for declared profiles and probed
facts alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from gpufleet.gpu.report import (
    SCHEMA,
    ClockEventReasons,
    Ecc,
    Fabric,
    Gpu,
    Mig,
    NodeFacts,
    NvLink,
    NvmlStatus,
    Pcie,
    RemappedRows,
)

Interconnect = Literal["SXM", "PCIe", "PCIe-pairs"]

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class GpuModel:
    """One GPU product as NVML names and sizes it."""

    key: str
    nvml_name: str
    memory_bytes: int
    compute_capability: str
    pcie_gen: int
    nvlinks: int  # links per GPU on an NVSwitch board or across a bridge pair (0: none)
    ecc: bool
    fabric_info: bool  # answers nvmlDeviceGetGpuFabricInfo (Hopper and newer)
    mig: bool
    interconnects: tuple[Interconnect, ...]
    # What CUDA (PyTorch, vLLM) reports as the GPU's total memory, where measured; None: estimated.
    framework_memory_bytes: int | None = None


GPU_MODELS: dict[str, GpuModel] = {
    m.key: m
    for m in (
        # 79.19 GiB: vLLM 0.19's "total_memory" on an H100 SXM (torch.cuda.mem_get_info), the lowest value that
        # prints so (79.185 GiB)
        GpuModel("H100", "NVIDIA H100 80GB HBM3", 81559 * MIB, "9.0", 5, 18, True, True, True, ("SXM",),
                 81085 * MIB),
        GpuModel("H200", "NVIDIA H200", 143771 * MIB, "9.0", 5, 18, True, True, True, ("SXM",)),
        GpuModel("H100NVL", "NVIDIA H100 NVL", 95830 * MIB, "9.0", 5, 18, True, False, True, ("PCIe-pairs", "PCIe")),
        # 79.15 GiB: PyTorch's "total capacity" on an A100 SXM 80GB (its out-of-memory message), less 0.005 GiB
        GpuModel("A100", "NVIDIA A100-SXM4-80GB", 81920 * MIB, "8.0", 4, 12, True, False, True, ("SXM",),
                 81044 * MIB),
        GpuModel("A100PCIe", "NVIDIA A100 80GB PCIe", 81920 * MIB, "8.0", 4, 12, True, False, True,
                 ("PCIe-pairs", "PCIe")),
        GpuModel("L40S", "NVIDIA L40S", 46068 * MIB, "8.9", 4, 0, True, False, False, ("PCIe",)),
        # 23.65 GiB: PyTorch's "total capacity" on an RTX 4090 (the lowest public figure), less 0.005 GiB
        GpuModel("RTX4090", "NVIDIA GeForce RTX 4090", 24564 * MIB, "8.9", 4, 0, False, False, False, ("PCIe",),
                 24212 * MIB),
    )
}
# The share of NVML's total a GPU without a measured figure is taken to lose to the driver: more than the
# measured ones do (H100 0.58%, A100 1.07%, RTX 4090 1.43%), so the planner errs low.
DRIVER_RESERVED_SHARE = 0.015

# Aliases accepted in profile names for the PCIe A100 (``4xA100-PCIe-pairs``).
_PCIE_VARIANT = {"A100": "A100PCIe"}

_NAME = re.compile(r"^(?P<count>\d+)x(?P<gpu>[A-Za-z0-9]+?)(?:-(?P<ic>SXM|PCIe-pairs|PCIe))?$")


def framework_memory_bytes(nvml_name: str, nvml_total_bytes: int) -> int:
    """The memory CUDA reports for a GPU whose NVML facts give ``nvml_name`` and ``nvml_total_bytes``.

    A known GPU loses what was measured for it (NVML's total less the framework's); any other GPU loses
    `DRIVER_RESERVED_SHARE` of its total, rounded down to whole MiB.
    """
    for model in GPU_MODELS.values():
        if model.nvml_name == nvml_name and model.framework_memory_bytes is not None:
            return max(0, nvml_total_bytes - (model.memory_bytes - model.framework_memory_bytes))
    return int(nvml_total_bytes * (1 - DRIVER_RESERVED_SHARE)) // MIB * MIB


class ProfileError(ValueError):
    """A profile name that names no known hardware."""


@dataclass(frozen=True)
class HardwareProfile:
    """A node shape: how many GPUs of which model, joined how."""

    name: str
    count: int
    gpu: GpuModel
    interconnect: Interconnect


def known_profiles() -> list[str]:
    """Example names for error messages and docs."""
    return ["8xH100-SXM", "8xH200-SXM", "8xA100-SXM", "8xL40S-PCIe", "4xA100-PCIe-pairs",
            "8xA100-PCIe-pairs", "2xRTX4090"]


def parse_profile(name: str) -> HardwareProfile:
    """Turn ``8xH100-SXM`` into a :class:`HardwareProfile`."""
    m = _NAME.match(name)
    if not m:
        raise ProfileError(f"expected a hardware profile like {', '.join(known_profiles()[:3])}, found {name!r}")
    count, key, ic = int(m["count"]), m["gpu"], m["ic"]
    if key not in GPU_MODELS:
        raise ProfileError(f"unknown GPU {key!r} in {name!r}; known: {', '.join(sorted(GPU_MODELS))}")
    if ic in ("PCIe", "PCIe-pairs") and key in _PCIE_VARIANT:
        key = _PCIE_VARIANT[key]
    gpu = GPU_MODELS[key]
    interconnect: Interconnect = ic or gpu.interconnects[0]  # type: ignore[assignment]
    if interconnect not in gpu.interconnects:
        raise ProfileError(f"{gpu.key} does not come as {interconnect}; it comes as {', '.join(gpu.interconnects)}")
    if not 1 <= count <= 16 or (interconnect == "PCIe-pairs" and count % 2):
        raise ProfileError(f"{name!r}: GPU count must be 1..16 (even for bridged pairs), found {count}")
    return HardwareProfile(name, count, gpu, interconnect)


def _bus_id(i: int) -> str:
    return f"00000000:{0x18 + 0x10 * i:02X}:00.0"


def _switch_bus_id(s: int) -> str:
    return f"00000000:{0x05 + s:02X}:00.0"


def _nvlinks(p: HardwareProfile, i: int) -> list[NvLink] | None:
    if p.interconnect == "PCIe":
        return None
    if p.interconnect == "SXM":
        return [NvLink(link=k, active=True, remote_pci_bus_id=_switch_bus_id(k % 4), remote_device_type="switch")
                for k in range(p.gpu.nvlinks)]
    peer = i ^ 1
    return [NvLink(link=k, active=True, remote_pci_bus_id=_bus_id(peer), remote_device_type="gpu")
            for k in range(p.gpu.nvlinks)]


def _numa(p: HardwareProfile, i: int) -> int:
    return 0 if i < max(1, p.count // 2) else 1


def _topology(p: HardwareProfile) -> list[list[str]]:
    rows = []
    for a in range(p.count):
        row = []
        for b in range(p.count):
            if a == b:
                row.append("X")
            elif p.interconnect == "SXM" or (p.interconnect == "PCIe-pairs" and a ^ 1 == b):
                row.append(f"NV{p.gpu.nvlinks}")
            else:
                row.append("NODE" if _numa(p, a) == _numa(p, b) else "SYS")
        rows.append(row)
    return rows


def profile_facts(name: str, hostname: str, driver_version: str = "580.95.05") -> NodeFacts:
    """The facts document a healthy node of this profile reports."""
    p = parse_profile(name)
    unsupported_base = [] if p.gpu.ecc else ["ecc", "remapped_rows"]
    gpus = []
    for i in range(p.count):
        unsupported = list(unsupported_base)
        if p.interconnect == "PCIe":
            unsupported.append("nvlinks")
        if not p.gpu.fabric_info:
            unsupported.append("fabric")
        if not p.gpu.mig:
            unsupported.append("mig")
        gpus.append(
            Gpu(
                index=i,
                uuid=f"GPU-{hostname[:8].encode().hex():0<16}-{i:04d}-0000-{p.gpu.key.encode().hex()[:12]:0<12}",
                name=p.gpu.nvml_name,
                pci_bus_id=_bus_id(i),
                memory_total_bytes=p.gpu.memory_bytes,
                compute_capability=p.gpu.compute_capability,
                persistence_mode=True,
                mig=Mig(current=False, pending=False) if p.gpu.mig else None,
                ecc=(Ecc(current=True, pending=True, uncorrected_volatile=0, uncorrected_aggregate=0)
                     if p.gpu.ecc else None),
                remapped_rows=RemappedRows(correctable=0, uncorrectable=0, pending=False, failure=False)
                if p.gpu.ecc
                else None,
                pcie=Pcie(gen_current=p.gpu.pcie_gen, gen_max=p.gpu.pcie_gen, width_current=16, width_max=16),
                clock_event_reasons=ClockEventReasons(mask=1, active=["gpu_idle"]),
                numa_node=_numa(p, i),
                cpu_affinity="0-63" if _numa(p, i) == 0 else "64-127",
                nvlinks=_nvlinks(p, i),
                fabric=Fabric(state="completed", status="success", clique_id=1,
                              cluster_uuid="00000000-0000-0000-0000-000000000001")
                if p.gpu.fabric_info and p.interconnect == "SXM"
                else None,
                unsupported=sorted(unsupported),
            )
        )
    return NodeFacts(
        schema=SCHEMA,
        hostname=hostname,
        nvml=NvmlStatus(available=True),
        driver_version=driver_version,
        cuda_driver_version="13.0",
        nvml_version=f"13.{driver_version}",
        gpus=gpus,
        topology=_topology(p),
    )
