"""How vLLM accounts for memory at start-up: per-version rules, batch defaults and the reserve beside the KV cache.

The figures and their sources live in ``gpufleet/data/vllm_memory.yml``; this module reads them and applies
them. `accounting` gives a version's rules (is the CUDA graph estimate taken from the KV budget, block sizes,
MLA padding, the GPU KV pool's safety margin), `batch_defaults` the batch sizes vLLM picks when none is given,
and `gpu_reserve` what one GPU of a pipeline stage keeps out of its KV pool besides weights: activations,
communication buffers, CUDA graphs.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from gpufleet.plan.model_arch import ModelArch

__all__ = ["Accounting", "Reserve", "accounting", "batch_defaults", "gpu_reserve"]

GIB = 1024**3


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Rules(_Data):
    cuda_graphs_in_budget: bool
    gpu_block_size: int
    cpu_block_size: int
    mla_entry_align_bytes: int
    kv_margin: float = Field(ge=0, lt=1)


class _VersionRule(_Data):
    since: str | None = None
    before: str | None = None
    cuda_graphs_in_budget: bool | None = None
    gpu_block_size: int | None = None
    cpu_block_size: int | None = None
    mla_entry_align_bytes: int | None = None
    kv_margin: float | None = Field(default=None, ge=0, lt=1)


class _GpuBatch(_Data):
    min_memory_gib: float
    except_names: list[str] = []
    tokens: int
    seqs: int


class _Batch(_Data):
    tokens: int
    seqs: int


class _BatchDefaults(_Data):
    gpu: list[_GpuBatch]
    cpu_per_rank: _Batch


class _Activation(_Data):
    forward_gib: float
    ffn_column_bytes: float
    sampler_gib: float
    logit_bytes: float
    hidden_bytes: float
    moe_hidden_bytes: float
    pp_receive_bytes: float


class _Communication(_Data):
    single: float
    pipeline: float
    tensor: dict[int, float]


class _CudaGraphs(_Data):
    single: float
    tensor: float


class _ReserveData(_Data):
    activation: _Activation
    communication_gib: _Communication
    cuda_graphs_gib: _CudaGraphs


class _MemoryData(_Data):
    defaults: _Rules
    versions: list[_VersionRule]
    batch_defaults: _BatchDefaults
    reserve: _ReserveData


@functools.cache
def _data() -> _MemoryData:
    text = (resources.files("gpufleet") / "data" / "vllm_memory.yml").read_text(encoding="utf-8")
    return _MemoryData.model_validate(yaml.safe_load(text))


def _version_key(version: str) -> tuple[int, ...]:
    """``0.19.0`` -> (0, 19, 0); a local or pre-release tail (``+cpu``, ``rc1``) is ignored."""
    numbers = re.match(r"^\d+(?:\.\d+)*", version.strip())
    if numbers is None:
        raise ValueError(f"expected a vLLM version like 0.33.0, found {version!r}")
    return tuple(int(part) for part in numbers.group().split("."))


@dataclass(frozen=True)
class Accounting:
    """One vLLM version's memory rules."""

    version: str
    cuda_graphs_in_budget: bool
    gpu_block_size: int
    cpu_block_size: int
    mla_entry_align_bytes: int
    kv_margin: float


def accounting(version: str) -> Accounting:
    """The rules of ``version``: the defaults, with every matching ``versions`` entry applied in file order."""
    data = _data()
    rules: dict[str, Any] = data.defaults.model_dump()
    key = _version_key(version)
    for entry in data.versions:
        if entry.since is not None and key < _version_key(entry.since):
            continue
        if entry.before is not None and key >= _version_key(entry.before):
            continue
        rules |= {name: value for name, value in entry.model_dump(exclude={"since", "before"}).items()
                  if value is not None}
    return Accounting(version=version, **rules)


def batch_defaults(platform: str, gpu_name: str, memory_bytes: int, ranks: int) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) vLLM's API server takes when neither is given.

    ``platform`` ``cpu``: per rank (TP x PP = ``ranks``); else by the GPU's framework memory and name.
    """
    data = _data().batch_defaults
    if platform == "cpu":
        return data.cpu_per_rank.tokens * ranks, data.cpu_per_rank.seqs * ranks
    name = gpu_name.lower()
    for row in data.gpu:
        if memory_bytes >= row.min_memory_gib * GIB and not any(n in name for n in row.except_names):
            return row.tokens, row.seqs
    last = data.gpu[-1]
    return last.tokens, last.seqs


@dataclass(frozen=True)
class Reserve:
    """What one GPU of a stage keeps out of its KV pool besides weights, in bytes."""

    activation: int
    communication: int
    cuda_graphs: int

    @property
    def total(self) -> int:
        return self.activation + self.communication + self.cuda_graphs

    def parts(self) -> tuple[tuple[str, int], ...]:
        """The non-zero parts, named as the budget lines name them."""
        named = (("activations", self.activation), ("communication", self.communication),
                 ("CUDA graphs", self.cuda_graphs))
        return tuple((name, size) for name, size in named if size)


def _ffn_columns(arch: ModelArch) -> int:
    """The widest FFN intermediate a token passes through: a dense MLP's, or its routed experts' and shared."""
    dense = arch.intermediate_size if arch.num_layers > arch.moe_layers else 0
    moe = arch.num_experts_per_tok * arch.moe_intermediate_size + arch.shared_expert_intermediate_size
    return max(dense, moe if arch.is_moe else 0)


def gpu_reserve(arch: ModelArch, *, stage: int, stages: int, tp: int, batched_tokens: int, max_num_seqs: int,
                enforce_eager: bool, rules: Accounting) -> Reserve:
    """The reserve of one GPU of ``stage`` (0-based, of ``stages``) at TP ``tp`` (see vllm_memory.yml)."""
    r = _data().reserve
    a = r.activation
    tokens, hidden = batched_tokens, arch.hidden_size
    forward = a.forward_gib * GIB + tokens * _ffn_columns(arch) / tp * a.ffn_column_bytes
    peak = forward
    if stage == stages - 1:
        logits = max_num_seqs * arch.vocab_size * a.logit_bytes
        peak = max(forward, a.sampler_gib * GIB + logits + tokens * hidden * a.hidden_bytes)
    if arch.is_moe:
        peak += tokens * arch.num_experts_per_tok * hidden * a.moe_hidden_bytes
    if stage > 0:
        peak += tokens * hidden * a.pp_receive_bytes
    comm = r.communication_gib
    if tp > 1:
        larger = [size for size in sorted(comm.tensor) if size >= tp]
        communication = comm.tensor[larger[0] if larger else max(comm.tensor)]
        communication += comm.pipeline if stages > 1 else 0.0
    else:
        communication = comm.pipeline if stages > 1 else comm.single
    graphs = 0.0
    if rules.cuda_graphs_in_budget and not enforce_eager:
        graphs = r.cuda_graphs_gib.tensor if tp > 1 else r.cuda_graphs_gib.single
    return Reserve(activation=int(peak), communication=int(communication * GIB), cuda_graphs=int(graphs * GIB))
