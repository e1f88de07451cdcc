"""From validated config and GPU facts to replicas: nodes, TP/PP/DP, GPU sets, ports, processes and env.

Pure: touches no host. Problems (:class:`PlanProblem`) carry the arithmetic that rules a layout out and the
variables it names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from gpufleet.config.fleet import Fleet
from gpufleet.config.schema import RECORDS, HostConfig, keys
from gpufleet.gpu.report import NodeFacts
from gpufleet.netaddr import host_port
from gpufleet.node_paths import replica_host_part
from gpufleet.plan import layout, quantization
from gpufleet.plan.admission import Admission, TypicalLengthError, UnsupportedLimitError, admission
from gpufleet.plan.commands import NodeRole, Process, extra_flags, replica_roles, secret_env_names
from gpufleet.plan.model_arch import ModelArch, ModelConfigError, load_arch
from gpufleet.plan.model_memory import (
    GIB,
    LORA_PART,
    KvBudget,
    bytes_per_param,
    kv_tokens_per_sequence,
    safetensors_total_size,
    weight_bytes,
)
from gpufleet.plan.priority import SCHEDULING_FLAG, schedules_by_priority
from gpufleet.plan.token_budgets import USAGE_FLAG, meters_tokens, shares_fairly
from gpufleet.values import grammar
from gpufleet.values.problems import shown_key
from gpufleet.values.types import SecretRef
from gpufleet.values.vllm_flags import load_catalog

POOL_WIDE = keys(scope="pool")
"""Settings every host of one pool must share (one model, one layout)."""
MODEL_WIDE = {name: f" {record.model_wide}" for name, record in RECORDS.items() if record.model_wide}
"""Values every pool that serves one model name must share, each with why (the router has one backend per served
model)."""
# vLLM's options that make a prefix's cache keys, which every replica of a model routed by prefix must share.
CACHE_KEY_OPTIONS = {"--block-size": "block size", "--prefix-caching-hash-algo": "prefix caching hash algorithm"}
PREFIX_CACHING = "--enable-prefix-caching"


@dataclass(frozen=True)
class Replica:
    """One vLLM server: on one node, or on several with pipeline (or tensor) parallel across them."""

    name: str
    pool: str
    model: str
    tp: int
    pp: int
    dp: int
    port: int
    backend: str
    max_model_len: int
    kv_bytes_per_token: int
    budget: KvBudget
    roles: list[NodeRole]
    secret_env: list[str]
    admission: Admission
    served: str  # the name clients ask for its model by: its pool's served model name (a ServedModel's)
    release: str  # the vLLM release its pool runs (vllm_version)
    starts: bool  # whether its units start (vllm_start of its first node, whose process serves its API)
    gpu_profile: str  # its nodes' GPU profiles, "+"-joined and sorted ("probed" for a node that declares none)
    api_key: SecretRef | None  # where the key its API takes is read (its first node's vllm_api_key)
    not_modelled: tuple[str, ...] = ()  # its flags that move memory the plan does not model (layout.NOT_MODELLED)

    @property
    def nodes(self) -> list[str]:
        return [r.host for r in self.roles]

    @property
    def api_address(self) -> str:
        """Where its API listens: ``ADDRESS:PORT`` on its first node."""
        return host_port(self.roles[0].address, self.port)

    @property
    def api_url(self) -> str:
        return f"http://{self.api_address}"

    def to_json(self) -> dict[str, Any]:
        """The plan's JSON form (keys other tools rely on)."""
        main = {r.host: r.processes[-1] for r in self.roles}
        return {
            "name": self.name, "pool": self.pool, "model": self.model, "nodes": self.nodes,
            "tp": self.tp, "pp": self.pp, "dp": self.dp, "port": self.port, "backend": self.backend,
            "max_model_len": self.max_model_len,
            "gpus": {r.host: r.gpus for r in self.roles},
            "roles": {r.host: r.role for r in self.roles},
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "weights_bytes_per_gpu": self.budget.weights_bytes_per_gpu,
            "kv_pool_bytes_per_gpu": self.budget.kv_pool_bytes,
            "kv_tokens_per_gpu": self.budget.kv_tokens,
            "max_concurrency": round(self.budget.max_concurrency * self.dp, 2),
            "router_maxconn": self.admission.maxconn,
            "router_maxconn_basis": self.admission.basis,
            "max_num_queued_reqs": self.admission.queued_reqs,
            "argv": {h: p.argv for h, p in main.items()},
            "env": {h: p.env for h, p in main.items()},
            "processes": {r.host: [{"unit": p.unit, "argv": p.argv, "env": p.env} for p in r.processes]
                          for r in self.roles},
            "secret_env": self.secret_env,
            "budget": self.budget.lines(),
            **({"not_modelled": list(self.not_modelled)} if self.not_modelled else {}),
        }

    def process_line(self, role: NodeRole, process: Process) -> str:
        """One process as ``gpufleet plan`` prints it: replica, host, unit, environment, command line."""
        env = " ".join(f"{k}={v}" for k, v in process.env.items())
        secrets = (f"  (+ {', '.join(self.secret_env)} from the 0600 EnvironmentFile)"
                   if self.secret_env and process.unit == "vllm" else "")
        return f"{self.name} {role.host} {process.unit}: {env} {' '.join(process.argv)}{secrets}"


@dataclass(frozen=True)
class PlanProblem:
    """Why the plan refuses a pool, or one replica's process on one host.

    ``keys`` are the variables the text names, the one it is about first; when the text starts with that
    variable, ``detail`` is the text after it (what a config problem about the variable says).
    """

    pool: str
    text: str
    host: str | None = None  # the host whose process it is about; None: the whole pool
    replica: str | None = None
    keys: tuple[str, ...] = ()
    detail: str | None = None
    also: tuple[str, ...] = ()  # the other pools it is about (pools that must agree): where the keys may be set

    def line(self) -> str:
        """As ``gpufleet plan`` and a deploy print it."""
        where = f"{self.replica} on {self.host}" if self.host is not None else f"pool {self.pool}"
        return f"{where}: {self.text}"

    def said_of(self, key: str) -> str:
        """The text for a problem reported against ``key``: without the key where the text starts with it."""
        return self.detail if self.detail is not None and self.keys and key == self.keys[0] else self.text

    def stops(self, host: str, pool: str | None) -> bool:
        """Whether it keeps ``host`` (of ``pool``) from serving: a problem of its pool, or of its own process."""
        return self.host == host if self.host is not None else self.pool == pool


_BACKEND_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")  # what HAProxy's names may not hold


@dataclass(frozen=True)
class ServedModel:
    """One name the fleet serves a model under, once: what every pool that serves it agrees on (:data:`MODEL_WIDE`,
    checked by the planner): its routers' backend and policy, its objectives, its replicas' keys and its replicas."""

    name: str  # what clients ask for
    backend: str  # the routers' backend: the name made a HAProxy name, unique in the fleet
    policy: Literal["leastconn", "prefix"]
    prefix_balance: float | None  # with prefix: router_prefix_balance
    ttft_p99_s: float  # the objective: vllm_slo_ttft_p99_s, vllm_slo_itl_p99_s
    itl_p99_s: float
    api_keys: tuple[SecretRef | None, ...]  # its replicas' keys (Replica.api_key), each once, the first replica's first
    tokenizer: str  # what a client counts its tokens with: vllm_model_config, else vllm_model
    pools: tuple[str, ...]
    replicas: tuple[str, ...]  # in the plan's order
    priority: bool = False  # its replicas schedule by the priority the routers set (gpufleet.plan.priority)
    metered: bool = False  # the routers' token ledger meters it (gpufleet.plan.token_budgets)
    fair: bool = False  # its clients share it fairly in tokens (gpufleet.plan.token_budgets)
    max_model_len: int = 0  # its replicas' (the first one's): a metered request without max_tokens reserves it
    # its LoRA adapters (vllm_lora_adapters of its pools), sorted by name, each with the replicas that serve it
    adapters: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """What clients may ask its replicas for: the model, then its adapters."""
        return (self.name, *(name for name, _ in self.adapters))


@dataclass
class FleetPlan:
    """Served models, replicas, warnings and problems for a whole fleet."""

    replicas: list[Replica] = field(default_factory=list)
    models: dict[str, ServedModel] = field(default_factory=dict)  # by name, sorted
    warnings: list[str] = field(default_factory=list)
    problems: list[PlanProblem] = field(default_factory=list)
    idle: list[str] = field(default_factory=list)
    context_warnings: list[str] = field(default_factory=list)  # a long max_model_len by default (long_context_warning)

    def problems_of(self, host: str, pool: str | None) -> list[PlanProblem]:
        """The problems that keep ``host`` (of ``pool``) from serving."""
        return [p for p in self.problems if p.stops(host, pool)]

    def model_of(self, replica: Replica) -> ServedModel:
        """The served model ``replica`` serves."""
        return self.models[replica.served]


class PoolError(Exception):
    """A pool that cannot be planned; the message shows why, with numbers, and ``keys`` what it names."""

    def __init__(self, text: str, keys: tuple[str, ...] = (), detail: str | None = None) -> None:
        super().__init__(text)
        self.text, self.keys, self.detail = text, keys, detail

    def problem(self, pool: str) -> PlanProblem:
        return PlanProblem(pool, self.text, keys=self.keys, detail=self.detail)


def _about(key: str, sep: str, detail: str) -> PoolError:
    """A pool error whose text starts with the variable it is about: ``key``, ``sep``, ``detail``."""
    return PoolError(f"{key}{sep}{detail}", (key,), detail)


_TP, _PP, _DP = "vllm_tensor_parallel_size", "vllm_pipeline_parallel_size", "vllm_data_parallel_size"


def _gpus(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def _arch_and_weights(cfg: HostConfig) -> tuple[ModelArch, int, str]:
    source = cfg.vllm_model_config or cfg.checkpoint()
    try:
        arch = load_arch(source)
    except ModelConfigError as exc:
        key = "vllm_model_config" if cfg.vllm_model_config else "vllm_model"
        raise _about(key, ": ", f"cannot read the model's config.json: {exc}") from None
    if cfg.vllm_quantization:
        try:
            bytes_per_param("bfloat16", cfg.vllm_quantization)
        except ValueError as exc:  # a quantization the planner has no weight size for
            raise PoolError(str(exc), ("vllm_quantization",)) from None
        if conflict := quantization.checkpoint_conflict(cfg.vllm_quantization, arch.checkpoint_quant_method):
            raise _about("vllm_quantization", ": ", conflict)
    path = Path(source)
    exact = safetensors_total_size(path if path.is_dir() else path.parent) if path.exists() else None
    total = weight_bytes(arch, cfg.vllm_dtype, cfg.vllm_quantization, exact)
    how = "model.safetensors.index.json total_size" if exact else "estimated from config.json"
    return arch, total, how


def _pool_value(value: object) -> str:
    """A pool-wide value as a disagreement shows it: a plain value as Python writes it; a mapping or list (the
    adapters) as compact JSON cut to a line, or "a value that looks like a credential (not shown)"."""
    if not isinstance(value, (dict, list, BaseModel)):
        return repr(value)
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=lambda v: v.model_dump(mode="json"))
    except (TypeError, ValueError, AttributeError):
        text = repr(value)
    return "a value that looks like a credential (not shown)" if grammar.secret_like(text) else grammar.show(text)


def _pool_config(pool: str, hosts: list[str], configs: dict[str, HostConfig]) -> HostConfig:
    first = configs[hosts[0]]
    for key in POOL_WIDE:
        values = {h: getattr(configs[h], key) for h in hosts}
        if len({repr(v) for v in values.values()}) > 1:
            shown = ", ".join(f"{h}={_pool_value(v)}" for h, v in values.items())
            raise _about(key, " ", f"differs across the hosts of one pool: {shown}")
    return first


def _check_same_gpus(shapes: list[layout.NodeShape]) -> None:
    names = {s.host: set(s.gpu_names) for s in shapes}
    seen = {n for v in names.values() for n in v}
    if len(seen) > 1:
        shown = "; ".join(f"{h}: {', '.join(sorted(v))}" for h, v in names.items())
        raise PoolError(f"different GPU models in one replica: {shown}")


def _fit_single_node(cfg: HostConfig, s: layout.Sizing, node: layout.NodeShape,
                     warnings: list[str]) -> tuple[int, int, KvBudget, int] | None:
    """(tp, pp, budget, kv per token) on one node, or None when no layout on one node fits."""
    arch, dp = s.arch, cfg.vllm_data_parallel_size
    pp = 1 if cfg.vllm_pipeline_parallel_size == "auto" else cfg.vllm_pipeline_parallel_size
    if cfg.vllm_tensor_parallel_size != "auto":
        tp = cfg.vllm_tensor_parallel_size
        b, per_token = layout.budget(s, node.memory_bytes, tp, pp)
        return (tp, pp, b, per_token) if b.fits else None
    within = layout.tp_candidates(arch, max(1, node.largest_island) // pp)
    anywhere = [tp for tp in layout.tp_candidates(arch, node.count // (pp * dp)) if tp not in within]
    best_one_seq = None
    for tp in within:
        b, per_token = layout.budget(s, node.memory_bytes, tp, pp)
        if layout.replica_concurrency(b, dp) >= cfg.vllm_min_concurrency:
            return tp, pp, b, per_token
        if b.fits and best_one_seq is None:
            best_one_seq = (tp, pp, b, per_token)
    if best_one_seq:
        warnings.append(
            f"{node.host}: TP {best_one_seq[0]} holds {best_one_seq[2].max_concurrency:.1f} sequences at"
            f" max_model_len, below vllm_min_concurrency {cfg.vllm_min_concurrency}")
        return best_one_seq
    for tp in anywhere:
        b, per_token = layout.budget(s, node.memory_bytes, tp, pp)
        if b.fits:
            return tp, pp, b, per_token
    return None


def _no_fit(cfg: HostConfig, s: layout.Sizing, node: layout.NodeShape, how: str) -> PoolError:
    """Why no replica fits one node, with the arithmetic; blamed on the LoRA slots' count when they alone make
    the difference (the reserve fits without them)."""
    tp = cfg.vllm_tensor_parallel_size if cfg.vllm_tensor_parallel_size != "auto" else max(
        layout.tp_candidates(s.arch, node.count) or [1])
    pp = 1 if cfg.vllm_pipeline_parallel_size == "auto" else cfg.vllm_pipeline_parallel_size
    b, _ = layout.budget(s, node.memory_bytes, tp, pp)
    where = f"on stage {b.stage + 1} of {pp}" if pp > 1 else "per GPU"
    head = (f"{s.arch.name}: weights {_gib(s.weights_total)} ({how}) at TP {tp} x PP {pp}:"
            f" {_gib(b.weights_bytes_per_gpu)} {where}; ")
    if b.kv_pool_bytes > 0:
        return PoolError(head + f"the KV pool cannot hold one sequence of {s.max_model_len:,} tokens"
                         " (max_model_len): " + "; ".join(b.lines()), (_TP, _PP))
    lora = sum(size for name, size in b.reserve_parts if name == LORA_PART)
    given = load_catalog(cfg.vllm_version).given(cfg.vllm_extra_args, "--max-loras")
    if lora and given and b.kv_pool_bytes + lora > 0:
        return _about(f"vllm_extra_args.{shown_key(given[0])}", ": ", f"expected LoRA slots that leave room for the"
                      f" KV pool, found {given[1]} slots that do not fit: " + "; ".join(b.lines()))
    return PoolError(head + "weights and reserve do not fit: " + "; ".join(b.lines()), (_TP, _PP))


LONG_DEFAULT_CONTEXT = 32768
"""A model default context from which ``vllm_max_model_len`` left unset is warned."""
CONTEXT_LENGTHS = (4096, 8192, 16384, 32768)
"""The lengths the warning's table shows, with the model's full length."""


def long_context_warning(pool: str, cfg: HostConfig, arch: ModelArch, replica: Replica) -> str | None:
    """A warning, with a table of the sequences one replica's KV pool holds at 4k, 8k, 16k, 32k and full length,
    when ``vllm_max_model_len`` is unset and the model's default context is ``LONG_DEFAULT_CONTEXT`` or more."""
    full = arch.max_position_embeddings
    if cfg.vllm_max_model_len is not None or full is None or full < LONG_DEFAULT_CONTEXT:
        return None
    b = replica.budget
    blocks = b.kv_tokens // b.block_size
    rows = [f"  {length:>11,} {blocks / -(-kv_tokens_per_sequence(arch, length) // b.block_size) * replica.dp:>10,.1f}"
            + (" (the model's default)" if length == full else "")
            for length in sorted({*(n for n in CONTEXT_LENGTHS if n < full), full})]
    return (f"pool {pool}: vllm_max_model_len unset: vLLM takes {arch.name}'s default, {full:,} tokens"
            " (max_position_embeddings), and the plan admits as many sequences of that length as the KV pool holds;"
            " set vllm_max_model_len to the longest request clients send. Sequences one replica holds at once:\n"
            f"  {'tokens':>11} {'sequences':>10}\n" + "\n".join(rows))


def _plan_pool(pool: str, hosts: list[str], fleet: Fleet, facts: dict[str, NodeFacts], plan: FleetPlan
               ) -> ModelArch:
    """Plan one pool's replicas into ``plan``; returns its model's architecture."""
    cfg = _pool_config(pool, hosts, fleet.configs)
    arch, weights_total, how = _arch_and_weights(cfg)
    limit = arch.max_position_embeddings
    max_len = cfg.vllm_max_model_len or limit or 4096
    if limit and max_len > limit:
        raise _about("vllm_max_model_len", " ", f"{max_len:,} is beyond {arch.name}'s limit of {limit:,} tokens"
                     " (max_position_embeddings)")
    shapes = [layout.node_shape(h, facts[h]) for h in hosts]
    for shape in shapes:
        if shape.count == 0:
            raise PoolError(f"{shape.host}: no GPUs in its facts")
    _check_fp8(pool, cfg, arch, shapes, plan.warnings)
    npr = cfg.vllm_nodes_per_replica
    smallest = min(shapes, key=lambda x: x.memory_bytes)
    dp = cfg.vllm_data_parallel_size
    s = _sizing(cfg, [fleet.configs[h] for h in hosts], arch, weights_total, max_len, smallest)
    tp_fixed = cfg.vllm_tensor_parallel_size
    if tp_fixed != "auto" and not layout.valid_tp(arch, tp_fixed):
        raise _about(
            _TP, " ", f"{tp_fixed} does not divide {arch.name}'s {arch.num_attention_heads} attention"
            f" heads ({arch.num_attention_heads} / {tp_fixed} = {arch.num_attention_heads / tp_fixed:g})"
            f" with {arch.num_kv_heads} KV heads; valid: {', '.join(map(str, layout.tp_candidates(arch, 64)))}")
    if tp_fixed != "auto" and tp_fixed > smallest.count:
        _check_same_gpus(shapes)
        _tp_across_nodes(pool, hosts, fleet, shapes, cfg, s, tp_fixed, how, plan)
        return arch

    single = None if npr not in ("auto", 1) else _fit_single_node(cfg, s, smallest, plan.warnings)
    if single is not None:
        tp, pp, b, per_token = single
        if tp * pp * dp > smallest.count:
            raise PoolError(f"TP {tp} x PP {pp} x DP {dp} = {tp * pp * dp} GPUs > {smallest.count} GPUs on"
                            f" {smallest.host}; for more, set vllm_nodes_per_replica",
                            (_TP, _PP, _DP, "vllm_nodes_per_replica"))
        admit = _admission(pool, cfg, b, layout.max_num_seqs(s, smallest.memory_bytes, tp, pp), dp, plan, fleet)
        _single_node_replicas(pool, hosts, fleet, shapes, cfg, tp, pp, b, per_token, max_len, admit, plan)
        return arch
    if npr == 1 or (npr == "auto" and len(hosts) == 1):
        raise _no_fit(cfg, s, smallest, how)
    _check_same_gpus(shapes)
    tp = tp_fixed if tp_fixed != "auto" else max(layout.tp_candidates(arch, smallest.largest_island or 1))
    counts = [npr] if npr != "auto" else list(range(2, len(hosts) + 1))
    for nodes in counts:
        b, per_token = layout.budget(s, smallest.memory_bytes, tp, nodes)
        if b.fits:
            admit = _admission(pool, cfg, b, layout.max_num_seqs(s, smallest.memory_bytes, tp, nodes), 1, plan,
                               fleet)
            _multi_node_replicas(pool, hosts, fleet, shapes, cfg, (tp, nodes, nodes, tp), b, per_token, max_len,
                                 admit, plan)
            return arch
    nodes = counts[-1]
    b, _ = layout.budget(s, smallest.memory_bytes, tp, nodes)
    raise PoolError(
        f"{arch.name} does not fit on {nodes} node(s) of {smallest.count} x {smallest.gpu_names[0]} at TP {tp}"
        f" x PP {nodes}: weights {_gib(weights_total)} ({how}); " + "; ".join(b.lines()), (_TP, _PP))


def _check_fp8(pool: str, cfg: HostConfig, arch: ModelArch, shapes: list[layout.NodeShape],
               warnings: list[str]) -> None:
    """fp8 where the pool's GPUs have none (gpufleet.plan.quantization): an fp8 KV cache refused below 7.0 and
    warned below 8.9 (converted in software), fp8 weights refused below 7.5 and warned below 8.9 (weight-only)."""
    known = [(cc, s) for s in shapes if (cc := quantization.capability(s.compute_capability)) is not None]
    if not known:
        return
    cc, shape = min(known, key=lambda found: found[0])
    gpu = f"{shape.gpu_names[0]} (compute capability {quantization.shown(cc)}, on {shape.host})"
    need = quantization.shown(quantization.FP8_COMPUTE)
    if cfg.vllm_kv_cache_dtype.startswith("fp8") and cc < quantization.FP8_KV_SOFTWARE:
        raise _about("vllm_kv_cache_dtype", ": ", f"expected auto, bfloat16 or float16 on {gpu}: vLLM keeps an fp8 KV"
                     f" cache from compute capability {quantization.shown(quantization.FP8_KV_SOFTWARE)}, found"
                     f" {cfg.vllm_kv_cache_dtype}")
    if cfg.vllm_kv_cache_dtype.startswith("fp8") and cc < quantization.FP8_COMPUTE:
        warnings.append(f"pool {pool}: the fp8 KV cache on {gpu} is converted in software (no fp8 below compute"
                        f" capability {need}): twice the tokens, no speed-up; vLLM needs an attention backend with an"
                        " fp8 cache there")
    method = cfg.vllm_quantization or arch.quant_method
    if not quantization.fp8_weights(method) or cc >= quantization.FP8_COMPUTE:
        return
    key = "vllm_quantization" if cfg.vllm_quantization else "vllm_model"
    if cc < quantization.FP8_MARLIN:
        raise _about(key, ": ", f"expected weights other than fp8 on {gpu}: vLLM runs fp8 weights from compute"
                     f" capability {quantization.shown(quantization.FP8_MARLIN)}, found {method}")
    warnings.append(f"pool {pool}: fp8 weights on {gpu} run weight-only (W8A16, FP8 Marlin): no fp8 compute below"
                    f" compute capability {need}")


def _sizing(cfg: HostConfig, cfgs: list[HostConfig], arch: ModelArch, weights_total: int, max_len: int,
            smallest: layout.NodeShape) -> layout.Sizing:
    """The pool's memory inputs: its model, dtypes and flags, its vLLM version's accounting, its platform."""
    kv_space = None
    if cfg.vllm_platform == "cpu":
        spaces = [c.cpu_kv_space_gib() for c in cfgs]
        if any(space is None for space in spaces):
            raise _about("vllm_env.VLLM_CPU_KVCACHE_SPACE", ": ", "expected a whole number of GiB with vllm_platform"
                         " cpu (each worker's KV cache), found none")
        kv_space = min(space or 0 for space in spaces) * GIB
    return layout.sizing(
        arch, weights_total, dtype=cfg.vllm_dtype, kv_dtype=cfg.vllm_kv_cache_dtype,
        utilization=cfg.vllm_gpu_memory_utilization, max_model_len=max_len, version=cfg.vllm_version,
        flags=extra_flags(cfg.serving_args()), platform=cfg.vllm_platform, gpu_name=smallest.gpu_names[0],
        reserve_bytes=None if cfg.vllm_memory_reserve_gib is None else int(cfg.vllm_memory_reserve_gib * GIB),
        kv_space_bytes=kv_space)


def _tp_across_nodes(pool: str, hosts: list[str], fleet: Fleet, shapes: list[layout.NodeShape], cfg: HostConfig,
                     s: layout.Sizing, tp: int, how: str, plan: FleetPlan) -> None:
    """A replica whose TP group spans nodes: ``vllm_tensor_parallel_size`` above one node's GPUs (TP 16 on two
    8-GPU nodes), each node holding an equal share of every TP group, PP stages after one another."""
    smallest = min(shapes, key=lambda x: x.memory_bytes)
    pp = 1 if cfg.vllm_pipeline_parallel_size == "auto" else cfg.vllm_pipeline_parallel_size
    per_node = max(d for d in range(1, smallest.count + 1) if tp % d == 0)
    nodes = tp // per_node * pp
    npr = cfg.vllm_nodes_per_replica
    if npr not in ("auto", nodes):
        raise _about("vllm_nodes_per_replica", " ", f"{npr} does not fit TP {tp} x PP {pp} on nodes of"
                     f" {_gpus(smallest.count)}: {tp // per_node} nodes of {_gpus(per_node)} per stage, {nodes} in all")
    if cfg.vllm_data_parallel_size > 1:
        raise _about(_DP, " ", f"{cfg.vllm_data_parallel_size} with TP across nodes: expected 1 (multi-node data"
                     " parallel is not planned yet)")
    if nodes > len(hosts):
        raise PoolError(f"TP {tp} x PP {pp} on nodes of {_gpus(smallest.count)} needs {nodes} nodes of"
                        f" {_gpus(per_node)}; pool {pool} has {len(hosts)} (TP up to {smallest.count} stays on one"
                        " node)", (_TP, _PP))
    b, per_token = layout.budget(s, smallest.memory_bytes, tp, pp)
    if not b.fits:
        raise PoolError(f"{s.arch.name} does not fit at TP {tp} x PP {pp} on {nodes} node(s) of {smallest.count} x"
                        f" {smallest.gpu_names[0]}: weights {_gib(s.weights_total)} ({how}); " + "; ".join(b.lines()),
                        (_TP, _PP))
    if per_node > smallest.largest_island:
        plan.warnings.append(f"pool {pool}: TP {tp} takes {_gpus(per_node)} of each node without NVLink between"
                             f" them (largest NVLink island: {_gpus(smallest.largest_island)})")
    plan.warnings.append(
        f"pool {pool}: TP {tp} spans {tp // per_node} nodes of {_gpus(per_node)}: every layer's all-reduce crosses"
        f" the network between them ({cfg.fleet_interface}), many times slower than NVLink; only worth it with"
        " RDMA (InfiniBand, RoCE) between the nodes; PP across nodes (TP up to one node's GPUs) needs far less")
    admit = _admission(pool, cfg, b, layout.max_num_seqs(s, smallest.memory_bytes, tp, pp), 1, plan, fleet)
    _multi_node_replicas(pool, hosts, fleet, shapes, cfg, (tp, pp, nodes, per_node), b, per_token, s.max_model_len,
                         admit, plan)


def _admission(pool: str, cfg: HostConfig, b: KvBudget, max_num_seqs: int, dp: int, plan: FleetPlan,
               fleet: Fleet) -> Admission:
    """The admission figures of a pool's replicas (they share one budget), and whether vLLM schedules them by
    priority; warned when vLLM's limit is below the router's maxconn."""
    catalog = load_catalog(cfg.vllm_version)
    try:
        found = admission(cfg, b, max_num_seqs, dp, catalog)
    except UnsupportedLimitError as exc:
        raise _about("vllm_max_num_queued_reqs", ": ", str(exc)) from None
    except TypicalLengthError as exc:
        raise _about("router_typical_request_tokens", ": ", str(exc)) from None
    model, configs = cfg.served_model_name(), fleet.configs.values()
    for switch, needed, flag, does, client in (
            ("priority", schedules_by_priority(model, configs), SCHEDULING_FLAG, "schedules by priority",
             "a client of the class interactive or batch"),
            ("usage", meters_tokens(model, configs) or shares_fairly(model, configs), USAGE_FLAG,
             "reports the usage of streamed answers", "a client with a token budget or a share")):
        if needed and not catalog.has(flag):
            raise _about("router_clients", ": ", f"expected a vLLM release that {does} for {model!r}, which {client}"
                         f" may use; vLLM {cfg.vllm_version} has no {flag}")
        if needed:
            found = replace(found, priority=found.priority or switch == "priority",
                            usage=found.usage or switch == "usage")
    if found.queued_reqs is not None and found.queued_reqs < found.maxconn:
        plan.warnings.append(
            f"pool {pool}: vllm_max_num_queued_reqs {found.queued_reqs} is below the router's maxconn {found.maxconn}"
            " of each replica: vLLM answers 503 to requests the router admitted")
    return found


def _single_node_replicas(pool: str, hosts: list[str], fleet: Fleet, shapes: list[layout.NodeShape],
                          cfg: HostConfig, tp: int, pp: int, b: KvBudget, per_token: int, max_len: int,
                          admit: Admission, plan: FleetPlan) -> None:
    size = tp * pp * cfg.vllm_data_parallel_size
    for shape in shapes:
        if size > shape.largest_island and shape.count > 1:
            plan.warnings.append(
                f"{shape.host}: TP {tp} spans GPUs without NVLink between them (largest NVLink island:"
                f" {shape.largest_island} GPUs); expect slow all-reduce over PCIe")
        sets = layout.gpu_sets(shape, size)
        want = cfg.vllm_replicas_per_node
        if want != "auto":
            if want > len(sets):
                raise _about("vllm_replicas_per_node", " ", f"{want} x {size} GPUs > {len(sets) * size} usable"
                             f" GPUs on {shape.host}")
            sets = sets[:want]
        host_cfg = fleet.configs[shape.host]
        address = host_cfg.fleet_address or shape.host
        for k, gpus in enumerate(sets):
            short = replica_host_part(shape.host)
            name = f"{pool}-{short}-{k}" if len(sets) > 1 else f"{pool}-{short}"
            roles = replica_roles([host_cfg], [shape.host], [address], [gpus], host_cfg.vllm_port + k,
                                  tp, pp, cfg.vllm_data_parallel_size, max_len, queued_reqs=admit.queued_reqs,
                                  priority=admit.priority, usage=admit.usage)
            plan.replicas.append(Replica(name, pool, cfg.checkpoint(), tp, pp, cfg.vllm_data_parallel_size,
                                         host_cfg.vllm_port + k, "single-node", max_len, per_token, b, roles,
                                         secret_env_names(host_cfg), admit, cfg.served_model_name(),
                                         cfg.vllm_version, host_cfg.vllm_start, _gpu_profile([host_cfg]),
                                         host_cfg.vllm_api_key,
                                         layout.not_modelled(cfg.serving_args(), b.lora_counted)))


def _multi_node_replicas(pool: str, hosts: list[str], fleet: Fleet, shapes: list[layout.NodeShape],
                         cfg: HostConfig, shape: tuple[int, int, int, int], b: KvBudget, per_token: int, max_len: int,
                         admit: Admission, plan: FleetPlan) -> None:
    """Replicas of ``shape`` (TP, PP, nodes, GPUs per node) on consecutive groups of the pool's hosts."""
    tp, pp, nodes, per_node = shape
    if nodes > len(hosts):
        raise _about("vllm_nodes_per_replica", " ", f"{nodes} > {len(hosts)} hosts in pool {pool}")
    if cfg.fleet_interface is None:
        raise _about("fleet_interface", ": ", f"expected an interface name for {nodes}-node replicas"
                     " (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME), found null")
    for k in range(len(hosts) // nodes):
        group = shapes[k * nodes:(k + 1) * nodes]
        cfgs = [fleet.configs[g.host] for g in group]
        gpus = []
        for g in group:
            sets = layout.gpu_sets(g, per_node)
            if not sets:
                raise PoolError(f"{g.host}: no set of {per_node} GPUs for TP {tp}", (_TP,))
            gpus.append(sets[0])
        addresses = [c.fleet_address or g.host for c, g in zip(cfgs, group, strict=True)]
        roles = replica_roles(cfgs, [g.host for g in group], addresses, gpus, cfgs[0].vllm_port,
                              tp, pp, 1, max_len, queued_reqs=admit.queued_reqs,
                              priority=admit.priority, usage=admit.usage)
        plan.replicas.append(Replica(f"{pool}-{k}", pool, cfg.checkpoint(), tp, pp, 1, cfgs[0].vllm_port,
                                     cfg.vllm_distributed_backend, max_len, per_token, b, roles,
                                     secret_env_names(cfgs[0]), admit, cfg.served_model_name(), cfg.vllm_version,
                                     cfgs[0].vllm_start, _gpu_profile(cfgs), cfgs[0].vllm_api_key,
                                     layout.not_modelled(cfg.serving_args(), b.lora_counted)))
    spare = hosts[(len(hosts) // nodes) * nodes:]
    if spare:
        plan.idle += spare
        plan.warnings.append(f"pool {pool}: {', '.join(spare)} left idle: a replica needs {nodes} nodes")


def _gpu_profile(cfgs: list[HostConfig]) -> str:
    """The GPU profiles of a replica's nodes, as its records and start keys name them."""
    return "+".join(sorted({str(cfg.gpu_profile or "probed") for cfg in cfgs}))


def _check_flags(plan: FleetPlan, fleet: Fleet) -> None:
    for replica in plan.replicas:
        version = replica.release
        catalog = load_catalog(version)
        for role in replica.roles:
            for proc in role.processes:
                if proc.unit != "vllm":
                    continue
                for problem in catalog.check_argv(proc.argv[2:]):
                    plan.problems.append(PlanProblem(replica.pool, f"vLLM {version}: {problem}", role.host,
                                                     replica.name, ("vllm_extra_args",)))


def _check_routing(plan: FleetPlan, fleet: Fleet) -> None:
    """Each served model's routing and objective: the pools that serve it agree on MODEL_WIDE; with router_policy
    prefix, each has prefix caching on and they agree on CACHE_KEY_OPTIONS (a problem of each pool that differs
    from the first)."""
    by_model: dict[str, list[tuple[str, HostConfig]]] = {}
    for pool, hosts in fleet.pools.items():
        cfg = fleet.configs[hosts[0]]
        by_model.setdefault(cfg.served_model_name(), []).append((pool, cfg))
    for model, pools in by_model.items():
        plan.problems += _routing_problems(json.dumps(model), pools)
    plan.problems += _adapter_name_problems(by_model)


def _adapter_name_problems(by_model: dict[str, list[tuple[str, HostConfig]]]) -> list[PlanProblem]:
    """An adapter named as another served model, or as another model's adapter: the routers route by name."""
    owner: dict[str, str] = {}
    found = []
    for model, pools in sorted(by_model.items()):
        for pool, name in sorted({(pool, name) for pool, cfg in pools for name in cfg.vllm_lora_adapters}):
            taken = owner.setdefault(name, model)
            if taken != model or name in by_model:
                what = "a served model's name" if name in by_model else f"an adapter of {json.dumps(taken)} too"
                detail = f"expected a name no other model or adapter has (the routers route by name), found {what}"
                found.append(PlanProblem(pool, f"vllm_lora_adapters.{name}: {detail}",
                                         keys=(f"vllm_lora_adapters.{name}",), detail=detail))
    return found


def _routing_problems(model: str, pools: list[tuple[str, HostConfig]]) -> list[PlanProblem]:
    """The problems of one served model's routing (``model``: its name as JSON)."""
    found = [problem for key, why in MODEL_WIDE.items() for problem in _disagreements(
        model, key, key, why, {pool: str(getattr(cfg, key)) for pool, cfg in pools})]
    if found or pools[0][1].router_policy != "prefix":
        return found
    found += [problem for pool, cfg in pools if (problem := _prefix_caching_off(pool, cfg))]
    shared = " with router_policy prefix (its replicas share cache keys)"
    for option, what in CACHE_KEY_OPTIONS.items():
        found += _disagreements(model, f"vllm_extra_args.{option.removeprefix('--')}", what, shared,
                                {pool: _cache_key_value(cfg, option) for pool, cfg in pools})
    return found


def _disagreements(model: str, key: str, what: str, why: str, values: dict[str, str]) -> list[PlanProblem]:
    """A problem of each pool whose value (``values``: by pool, as shown) differs from the first pool's."""
    (first, expected), *others = values.items()
    found = []
    for pool, shown in others:
        if shown != expected:
            detail = (f"expected the same {what} on every pool that serves {model}{why}, found {expected} in pool"
                      f" {first} and {shown} in pool {pool}")
            found.append(PlanProblem(pool, f"{key}: {detail}", keys=(key,), detail=detail, also=(first,)))
    return found


def _cache_key_value(cfg: HostConfig, option: str) -> str:
    """A cache key option's value on a pool's replicas as a problem shows it: set, else its vLLM's default."""
    catalog = load_catalog(cfg.vllm_version)
    given = catalog.given(cfg.vllm_extra_args, option)
    spec = catalog.spec(option)
    value = given[1] if given is not None else spec.default if spec is not None else None
    return "the default" if value is None else str(value)


def _prefix_caching_off(pool: str, cfg: HostConfig) -> PlanProblem | None:
    """A problem when ``vllm_extra_args`` turns prefix caching off on a pool whose router_policy is prefix."""
    given = load_catalog(cfg.vllm_version).given(cfg.vllm_extra_args, PREFIX_CACHING)
    if given is None or given[1] is not False:
        return None
    key = f"vllm_extra_args.{shown_key(given[0])}"
    detail = ("expected prefix caching on with router_policy prefix (the router sends requests that share a prefix"
              " to the replica that has it cached), found it off")
    return PlanProblem(pool, f"{key}: {detail}", keys=(key, "router_policy"), detail=detail)


def served_models(replicas: Iterable[Replica], configs: Mapping[str, HostConfig]) -> dict[str, ServedModel]:
    """Each served model of ``replicas``, by name, sorted; its routing, objectives and tokenizer are its first
    replica's first node's (every pool of the model has the same: :func:`_check_routing`), its keys its replicas'."""
    by_name: dict[str, list[Replica]] = {}
    for replica in replicas:
        by_name.setdefault(replica.served, []).append(replica)
    found: dict[str, ServedModel] = {}
    taken: set[str] = set()
    for name, served in sorted(by_name.items()):
        backend = base = "model-" + _BACKEND_UNSAFE.sub("_", name)
        suffix = 2
        while backend in taken:
            backend, suffix = f"{base}-{suffix}", suffix + 1
        taken.add(backend)
        cfg = configs[served[0].nodes[0]]
        adapters = _adapters(served, configs)
        found[name] = ServedModel(
            name, backend, cfg.router_policy,
            cfg.router_prefix_balance if cfg.router_policy == "prefix" or adapters else None,
            cfg.vllm_slo_ttft_p99_s, cfg.vllm_slo_itl_p99_s, tuple(dict.fromkeys(r.api_key for r in served)),
            str(cfg.vllm_model_config or cfg.vllm_model), tuple(dict.fromkeys(r.pool for r in served)),
            tuple(r.name for r in served), any(r.admission.priority for r in served),
            metered=meters_tokens(name, configs.values()), fair=shares_fairly(name, configs.values()),
            max_model_len=served[0].max_model_len, adapters=adapters)
    return found


def _adapters(served: list[Replica], configs: Mapping[str, HostConfig]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Each adapter of one model's replicas (their pools' vllm_lora_adapters), by name, with the replicas that
    serve it."""
    holders: dict[str, list[str]] = {}
    for replica in served:
        for name in configs[replica.nodes[0]].vllm_lora_adapters:
            holders.setdefault(name, []).append(replica.name)
    return tuple((name, tuple(holders[name])) for name in sorted(holders))


def plan_fleet(fleet: Fleet, facts: dict[str, NodeFacts]) -> FleetPlan:
    """Plan every pool; a pool that cannot be planned adds a problem and no replicas."""
    plan = FleetPlan()
    for pool, hosts in fleet.pools.items():
        try:
            arch = _plan_pool(pool, hosts, fleet, facts, plan)
            first = next((r for r in plan.replicas if r.pool == pool), None)
            if first and (warning := long_context_warning(pool, fleet.configs[hosts[0]], arch, first)):
                plan.context_warnings.append(warning)
        except PoolError as exc:
            plan.problems.append(exc.problem(pool))
        except ValueError as exc:  # a value the planner cannot size
            plan.problems.append(PlanProblem(pool, str(exc)))
    _check_flags(plan, fleet)
    _check_routing(plan, fleet)
    plan.models = served_models(plan.replicas, fleet.configs)
    return plan
