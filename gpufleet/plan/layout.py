"""The TP rule, the PP rule and GPU sets: how one replica spreads over GPUs and nodes.

- TP must divide the attention heads (and be compatible with the KV heads: one divides the other).
- ``auto`` TP is the smallest that fits inside one NVLink island with at least
  ``vllm_min_concurrency`` sequences at max_model_len; failing that, the smallest inside an island
  that holds one sequence (warned); failing that, TP over PCIe (warned).
- PP across nodes only when no single node can hold the model: then TP takes a whole island and
  PP is the smallest node count that fits.
- GPU sets are carved from islands, so every TP group stays on NVLink.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.gpu_facts import NodeFacts
from gpufleet.model_arch import ModelArch
from gpufleet.model_memory import KvBudget, kv_budget, kv_bytes_per_token, kv_tokens_per_sequence, weights_bytes_per_gpu
from gpufleet.topology import nvlink_islands


@dataclass(frozen=True)
class NodeShape:
    """What placement needs to know about one node's GPUs."""

    host: str
    gpu_names: tuple[str, ...]
    memory_bytes: int  # the smallest GPU's
    islands: tuple[tuple[int, ...], ...]
    numa: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.gpu_names)

    @property
    def largest_island(self) -> int:
        return max((len(i) for i in self.islands), default=0)


def node_shape(host: str, facts: NodeFacts) -> NodeShape:
    """Summarise a node's facts for placement."""
    gpus = sorted(facts.gpus, key=lambda g: g.index)
    return NodeShape(
        host=host,
        gpu_names=tuple(g.name for g in gpus),
        memory_bytes=min((g.memory_total_bytes for g in gpus), default=0),
        islands=tuple(tuple(i) for i in nvlink_islands(facts)),
        numa=tuple(g.numa_node if g.numa_node is not None else 0 for g in gpus),
    )


@dataclass(frozen=True)
class Sizing:
    """The memory inputs shared by every candidate layout of one pool."""

    arch: ModelArch
    weights_total: int
    model_dtype: str
    kv_dtype: str
    utilization: float
    reserve_bytes: int
    max_model_len: int


def budget(s: Sizing, memory_bytes: int, tp: int, pp: int, dp: int = 1) -> tuple[KvBudget, int]:
    """The KV budget of one GPU at this layout, and the KV bytes per token per GPU."""
    per_token = kv_bytes_per_token(s.arch, s.kv_dtype, s.model_dtype, tp=tp, pp=pp)
    weights = weights_bytes_per_gpu(s.weights_total, tp, pp)
    b = kv_budget(memory_bytes, s.utilization, weights, s.reserve_bytes, per_token,
                  kv_tokens_per_sequence(s.arch, s.max_model_len))
    return b, per_token


def valid_tp(arch: ModelArch, tp: int) -> bool:
    """vLLM's TP rule: TP divides the attention heads, and TP and the KV heads divide one another."""
    kv = arch.num_kv_heads
    return arch.num_attention_heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)


def tp_candidates(arch: ModelArch, limit: int) -> list[int]:
    """Valid TP sizes up to ``limit``, smallest first."""
    return [tp for tp in range(1, limit + 1) if valid_tp(arch, tp)]


def replica_concurrency(b: KvBudget, dp: int = 1) -> float:
    """Sequences at max_model_len one replica holds (data-parallel ranks each hold their own)."""
    return b.max_concurrency * dp


def gpu_sets(node: NodeShape, size: int) -> list[list[int]]:
    """Disjoint GPU sets of ``size``: within NVLink islands when they are big enough, else by NUMA node."""
    sets: list[list[int]] = []
    if size <= node.largest_island:
        for island in node.islands:
            for start in range(0, len(island) - size + 1, size):
                sets.append(list(island[start:start + size]))
        return sets
    by_numa: dict[int, list[int]] = {}
    for index, numa in enumerate(node.numa):
        by_numa.setdefault(numa, []).append(index)
    leftovers: list[int] = []
    for members in by_numa.values():
        while len(members) >= size:
            sets.append(members[:size])
            members = members[size:]
        leftovers += members
    for start in range(0, len(leftovers) - size + 1, size):
        sets.append(leftovers[start:start + size])
    return sets
