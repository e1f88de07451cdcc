"""The TP rule, the PP rule and GPU sets: how one replica spreads over GPUs and nodes.

- TP must divide the attention heads (and be compatible with the KV heads: one divides the other).
- ``auto`` TP is the smallest that fits inside one NVLink island with at least
  ``vllm_min_concurrency`` sequences at max_model_len; failing that, the smallest inside an island
  that holds one sequence (warned); failing that, TP over PCIe (warned).
- PP across nodes only when no single node can hold the model: then TP takes a whole island and
  PP is the smallest node count that fits.
- TP across nodes only when asked: a TP size above one node's GPUs spreads every TP group evenly over
  ``TP / GPUs per node`` nodes (planner.py).
- GPU sets are carved from islands, so every TP group stays on NVLink.
- A layout's memory is its worst pipeline stage's: each stage's weights and reserve (gpufleet.plan.vllm_memory)
  leave its own KV pool, and the stage with the fewest blocks sizes the cache, as in vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpufleet.gpu.profiles import framework_memory_bytes
from gpufleet.gpu.report import NodeFacts
from gpufleet.gpu.topology import nvlink_islands
from gpufleet.plan.model_arch import ModelArch
from gpufleet.plan.model_memory import (
    GIB,
    LORA_PART,
    KvBudget,
    bytes_per_param,
    kv_budget,
    kv_bytes_per_token,
    kv_fixed_budget,
    kv_space_budget,
    kv_tokens_per_sequence,
    lora_modelled,
    lora_slot_bytes,
    stage_weights_per_gpu,
)
from gpufleet.plan.quantization import capability
from gpufleet.plan.vllm_memory import Accounting, accounting, batch_defaults, gpu_reserve
from gpufleet.values.vllm_flags import (
    DEFAULT_VLLM_VERSION,
    SUPPORTED_VLLM_VERSIONS,
    FlagCatalog,
    human_int,
    load_catalog,
)


@dataclass(frozen=True)
class NodeShape:
    """What placement needs to know about one node's GPUs."""

    host: str
    gpu_names: tuple[str, ...]
    memory_bytes: int  # the smallest GPU's, as the framework sees it (framework_memory_bytes)
    nvml_memory_bytes: int  # the smallest GPU's, as NVML reports it
    islands: tuple[tuple[int, ...], ...]
    numa: tuple[int, ...]
    compute_capability: str | None = None  # the lowest of its GPUs' (``9.0``); None when the facts lack it

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
        memory_bytes=min((framework_memory_bytes(g.name, g.memory_total_bytes) for g in gpus), default=0),
        nvml_memory_bytes=min((g.memory_total_bytes for g in gpus), default=0),
        islands=tuple(tuple(i) for i in nvlink_islands(facts)),
        numa=tuple(g.numa_node if g.numa_node is not None else 0 for g in gpus),
        compute_capability=_lowest_capability([g.compute_capability for g in gpus]),
    )


def _lowest_capability(values: list[str | None]) -> str | None:
    """The lowest compute capability of a node's GPUs; None when any is unknown."""
    known = [(cc, value) for value in values if (cc := capability(value)) is not None]
    return min(known)[1] if known and len(known) == len(values) else None


@dataclass(frozen=True)
class Sizing:
    """The memory inputs shared by every candidate layout of one pool.

    ``platform`` ``cpu`` is vLLM's CPU build: each worker's KV pool is ``kv_space_bytes``
    (VLLM_CPU_KVCACHE_SPACE). ``batched_tokens``, ``max_num_seqs`` and ``block_size`` are the replica's
    flags, None for vLLM's defaults (without chunked prefill, a batch holds at least max_model_len tokens);
    ``reserve_bytes`` replaces the modelled reserve when set.
    """

    arch: ModelArch
    weights_total: int
    model_dtype: str
    kv_dtype: str
    utilization: float
    max_model_len: int
    rules: Accounting
    platform: str = "cuda"
    gpu_name: str = ""
    batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool = False
    chunked_prefill: bool = True
    block_size: int | None = None
    reserve_bytes: int | None = None
    kv_space_bytes: int | None = None
    kv_cache_bytes: int | None = None
    cpu_offload_bytes: int = 0
    lora: tuple[int, int] | None = None  # --enable-lora's slots: (max loras, max rank); None: no LoRA


NOT_MODELLED = ("--speculative-config", "--max-cpu-loras", "--lora-modules", "--kv-offloading-size",
                "--kv-transfer-config", "--num-gpu-blocks-override", "--offload-group-size", "--offload-num-in-group",
                "--offload-prefetch-step", "--offload-params", "--cpu-offload-params")
"""``vllm serve`` flags that move GPU memory and that the plan's memory does not model: a draft model and its KV
cache, LoRA adapters kept in host memory and loaded at start, KV offloading and transfer buffers, a forced block
count, layer prefetch offloading."""
LORA_SLOT_FLAGS = ("--enable-lora", "--max-loras", "--max-lora-rank")
"""The LoRA slots' flags: modelled for dense attention models (model_memory.lora_slot_bytes), not for the others."""


def not_modelled(flags: Mapping[str, Any], lora_counted: bool = False) -> tuple[str, ...]:
    """The `NOT_MODELLED` flags among ``flags`` (names without dashes), in their order, and the LoRA slots' flags
    unless the budget counted the slots (``lora_counted``: a dense model on GPUs); a switch set false or a null
    value is no flag."""
    unmodelled = NOT_MODELLED + (() if lora_counted else LORA_SLOT_FLAGS)
    found = ["--" + name.partition(".")[0].replace("_", "-") for name, value in flags.items()
             if value is not False and value is not None]
    return tuple(dict.fromkeys(flag for flag in found if flag in unmodelled))


def lora_slots(flags: Mapping[str, Any], catalog: FlagCatalog) -> tuple[int, int] | None:
    """``--enable-lora``'s (max loras, max rank) as ``flags`` (``vllm_extra_args``) set them, the release's defaults
    (``catalog``) where left out; None without LoRA."""
    enabled = catalog.given(flags, "--enable-lora")
    if enabled is None or enabled[1] is not True:
        return None

    def value(flag: str) -> int:
        given = catalog.given(flags, flag)
        spec = catalog.spec(flag)
        return (_int_flag({"": given[1]}, "") if given else None) or int(spec.default if spec else 1)

    return value("--max-loras"), value("--max-lora-rank")


def _int_flag(flags: Mapping[str, Any], name: str) -> int | None:
    """An integer flag (``8192``, ``"8k"``), None when absent or not a number."""
    value = flags.get(name)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return human_int(value) if isinstance(value, str) else None
    except ValueError:
        return None


def sizing(arch: ModelArch, weights_total: int, *, dtype: str, kv_dtype: str, utilization: float,
           max_model_len: int, version: str, flags: Mapping[str, Any], platform: str = "cuda", gpu_name: str = "",
           reserve_bytes: int | None = None, kv_space_bytes: int | None = None) -> Sizing:
    """A pool's `Sizing`: ``dtype`` ``auto`` is the checkpoint's; of the ``vllm serve`` ``flags`` (names without
    dashes), those that move memory and are modelled: max-num-batched-tokens, max-num-seqs, enforce-eager,
    enable-chunked-prefill, block-size, kv-cache-memory-bytes (the pool's size), cpu-offload-gb (weights kept in
    RAM, per GPU)."""
    named = {name.replace("_", "-"): value for name, value in flags.items()}
    kv_cache = _int_flag(named, "kv-cache-memory-bytes")
    offload = named.get("cpu-offload-gb")
    offload_gib = offload if isinstance(offload, (int, float)) and not isinstance(offload, bool) else 0
    return Sizing(
        arch, weights_total, dtype if dtype != "auto" else (arch.torch_dtype or "bfloat16"), kv_dtype, utilization,
        max_model_len, accounting(version), platform=platform, gpu_name=gpu_name,
        batched_tokens=_int_flag(named, "max-num-batched-tokens"), max_num_seqs=_int_flag(named, "max-num-seqs"),
        enforce_eager=named.get("enforce-eager") is True,
        chunked_prefill=named.get("enable-chunked-prefill") is not False, block_size=_int_flag(named, "block-size"),
        reserve_bytes=reserve_bytes, kv_space_bytes=kv_space_bytes,
        kv_cache_bytes=kv_cache if kv_cache is not None and kv_cache > 0 else None,
        cpu_offload_bytes=max(0, int(offload_gib * GIB)),
        lora=lora_slots(flags, _catalog(version)) if lora_modelled(arch) else None)


def _catalog(version: str) -> FlagCatalog:
    """The release's flag catalog; the newest one for a release gpufleet does not deploy (the accounting of older
    releases is kept for the plan's accuracy records)."""
    return load_catalog(version if version in SUPPORTED_VLLM_VERSIONS else DEFAULT_VLLM_VERSION)


def _stage_budget(s: Sizing, memory_bytes: int, tp: int, pp: int, stage: int, weights: int) -> KvBudget:
    per_token = kv_bytes_per_token(s.arch, s.kv_dtype, s.model_dtype, tp=tp, pp=pp, stage=stage,
                                   mla_entry_align_bytes=s.rules.mla_entry_align_bytes)
    per_sequence = kv_tokens_per_sequence(s.arch, s.max_model_len)
    if s.platform == "cpu":
        block = s.block_size or (16 if s.arch.is_mla else s.rules.cpu_block_size)
        return kv_space_budget(s.kv_space_bytes or 0, weights, per_token, per_sequence, block_size=block,
                               stage=stage, stages=pp)
    tokens, seqs = batch_defaults(s.platform, s.gpu_name, memory_bytes, tp * pp)
    if not s.chunked_prefill:
        tokens = max(tokens, s.max_model_len)
    reserve = gpu_reserve(s.arch, stage=stage, stages=pp, tp=tp, batched_tokens=s.batched_tokens or tokens,
                          max_num_seqs=s.max_num_seqs or seqs, enforce_eager=s.enforce_eager, rules=s.rules)
    size, parts = (reserve.total, reserve.parts()) if s.reserve_bytes is None else (s.reserve_bytes, ())
    if s.lora is not None:
        slots = lora_slot_bytes(s.arch, max_loras=s.lora[0], rank=s.lora[1], tp=tp, pp=pp, stage=stage,
                                dtype_bytes=math.ceil(bytes_per_param(s.model_dtype, None)))
        size, parts = size + slots, (*parts, (LORA_PART, slots))
    if s.kv_cache_bytes is not None:
        return kv_fixed_budget(memory_bytes, s.kv_cache_bytes, weights, size, per_token, per_sequence,
                               block_size=s.block_size or s.rules.gpu_block_size, reserve_parts=parts, stage=stage,
                               stages=pp)
    return kv_budget(memory_bytes, s.utilization, weights, size, per_token, per_sequence,
                     block_size=s.block_size or s.rules.gpu_block_size, reserve_parts=parts, stage=stage, stages=pp,
                     kv_margin=s.rules.kv_margin)


def budget(s: Sizing, memory_bytes: int, tp: int, pp: int) -> tuple[KvBudget, int]:
    """The KV budget of one GPU of the stage that sizes the cache at this layout (the fewest tokens; the
    smallest pool when none fits), and that stage's KV bytes per token per GPU."""
    weights = [max(0, w - s.cpu_offload_bytes)
               for w in stage_weights_per_gpu(s.arch, s.weights_total, tp, pp, s.model_dtype)]
    stages = [_stage_budget(s, memory_bytes, tp, pp, k, w) for k, w in enumerate(weights)]
    worst = min(stages, key=lambda b: (b.kv_tokens, b.kv_pool_bytes))
    return worst, worst.kv_bytes_per_token


def max_num_seqs(s: Sizing, memory_bytes: int, tp: int, pp: int) -> int:
    """The sequences one data-parallel rank of this layout schedules at once: ``--max-num-seqs``, else vLLM's
    default for the platform and GPU (the figure the reserve is sized with)."""
    return s.max_num_seqs or batch_defaults(s.platform, s.gpu_name, memory_bytes, tp * pp)[1]


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
