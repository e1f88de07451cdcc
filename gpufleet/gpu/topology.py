"""NVLink islands: which GPUs of a node can share a tensor-parallel group over NVLink.

An island is a connected component of active GPU-to-GPU NVLinks. Every GPU with an active link
to an NVSwitch belongs to the node's switch island, provided its fabric registration completed
(or the GPU predates fabric info, as the A100 does). A GPU with no usable NVLink is an island
of one.
"""

from __future__ import annotations

import itertools

from gpufleet.gpu.report import Gpu, NodeFacts


def _norm_bus(bus_id: str) -> str:
    """NVML reports bus ids with 8 or 4 domain digits and either case."""
    domain, _, rest = bus_id.lower().partition(":")
    return f"{int(domain, 16):08x}:{rest}" if rest else bus_id.lower()


def _on_switch_fabric(gpu: Gpu) -> bool:
    links = gpu.nvlinks or []
    if not any(link.active and link.remote_device_type == "switch" for link in links):
        return False
    return gpu.fabric is None or gpu.fabric.state in ("completed", "not_supported")


def nvlink_islands(facts: NodeFacts) -> list[list[int]]:
    """GPU indices grouped by NVLink reachability, each island sorted, islands by first index."""
    by_bus = {_norm_bus(g.pci_bus_id): g.index for g in facts.gpus}
    parent = {g.index: g.index for g in facts.gpus}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(a: int, b: int) -> None:
        parent[find(a)] = find(b)

    switch_members = [g.index for g in facts.gpus if _on_switch_fabric(g)]
    for a, b in itertools.pairwise(switch_members):
        union(a, b)
    for g in facts.gpus:
        for link in g.nvlinks or []:
            if link.active and link.remote_device_type == "gpu" and link.remote_pci_bus_id:
                peer = by_bus.get(_norm_bus(link.remote_pci_bus_id))
                if peer is not None:
                    union(g.index, peer)

    groups: dict[int, list[int]] = {}
    for g in facts.gpus:
        groups.setdefault(find(g.index), []).append(g.index)
    return sorted((sorted(v) for v in groups.values()), key=lambda island: island[0])

