"""Memory math for serving a model with vLLM: parameters, weight bytes, KV cache per token, the KV pool.

The KV rules follow vLLM (``vllm/v1/kv_cache_interface.py``, ``config/model.py``):

- standard attention, per token per GPU: ``2 x layers_on_stage x max(1, kv_heads // tp) x head_dim x bytes``
  (K and V; KV heads are replicated when TP exceeds them);
- MLA (DeepSeek-V2/V3): one latent of ``kv_lora_rank + qk_rope_head_dim`` per layer, not split by TP;
- ``fp8*`` KV cache dtypes take 1 byte per element, ``auto`` takes the model dtype;
- pipeline stages hold vLLM's share of the layers (`stage_layers`); the first also holds the input embedding,
  the last the output head (its own copy of a tied embedding when PP > 1) and the final norm;
- the pool is ``utilization x GPU memory - weights on that GPU - reserve`` (gpufleet.plan.vllm_memory), counted in
  whole blocks of tokens; on a GPU the plan counts ``pool x (1 - kv_margin)`` of it (gpufleet/data/vllm_memory.yml).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet.plan.model_arch import ModelArch, ModelConfigError

__all__ = [
    "KvBudget",
    "bytes_per_param",
    "kv_budget",
    "kv_bytes_per_token",
    "kv_fixed_budget",
    "kv_space_budget",
    "kv_tokens_per_sequence",
    "model_info",
    "param_count",
    "safetensors_total_size",
    "stage_layers",
    "stage_weights_per_gpu",
    "weight_bytes",
]

GIB = 1024**3

_DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float32": 4, "fp32": 4, "float": 4,
    "fp8": 1, "int8": 1,
}
# 4-bit integer weights (AWQ/GPTQ) in groups of 128: each group adds a 16-bit scale and a 4-bit
# zero point, 2.5 bytes per 128 weights, so 0.5 + 2.5/128 = ~0.52 bytes per parameter.
_INT4 = 0.5 + 2.5 / 128
_QUANT_BYTES: dict[str, float] = {
    "fp8": 1.0, "fbgemm_fp8": 1.0, "modelopt": 1.0,  # per-tensor/channel/block scales: negligible
    "int8": 1.0, "w8a8": 1.0, "w8a16": 1.0,
    "int4": _INT4, "w4a16": _INT4, "awq": _INT4, "awq_marlin": _INT4, "gptq": _INT4, "gptq_marlin": _INT4,
    "mxfp4": 0.5 + 1 / 32,  # one 8-bit scale per 32 weights
    "nvfp4": 0.5 + 1 / 16, "modelopt_fp4": 0.5 + 1 / 16,  # one fp8 scale per 16 weights
}
_KV_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")


# -- parameters ------------------------------------------------------------------------------------


def _embedding_params(arch: ModelArch) -> int:
    """Input embedding plus the lm_head when it is not tied to it."""
    tables = 1 if arch.tie_word_embeddings else 2
    return tables * arch.vocab_size * arch.hidden_size


def _attention_params(arch: ModelArch) -> int:
    """One layer's attention projections (and, for MLA, its two latent norms)."""
    h, heads = arch.hidden_size, arch.num_attention_heads
    if arch.is_mla:
        rope, nope = arch.qk_rope_head_dim or 0, arch.qk_nope_head_dim or 0
        v_dim = arch.v_head_dim or nope
        kv_rank = arch.kv_lora_rank or 0
        q_head = heads * (nope + rope)
        # A low-rank q: up(norm(down(x))); else one projection.
        q = h * arch.q_lora_rank + arch.q_lora_rank + arch.q_lora_rank * q_head if arch.q_lora_rank else h * q_head
        kv_down = h * (kv_rank + rope) + kv_rank  # latent + shared rope key, then the latent norm
        kv_up = kv_rank * heads * (nope + v_dim)
        return q + kv_down + kv_up + heads * v_dim * h
    q_out, kv_out = heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    bias = q_out + 2 * kv_out if arch.attention_bias else 0
    return h * q_out + 2 * h * kv_out + q_out * h + bias


def _padded_vocab(arch: ModelArch) -> int:
    """The vocabulary vLLM allocates: padded to a multiple of 64 (VocabParallelEmbedding)."""
    return -(-arch.vocab_size // 64) * 64


def _moe_block_params(arch: ModelArch) -> int:
    """One MoE layer's MLP: routed experts, shared experts, router."""
    h = arch.hidden_size
    experts = arch.num_experts * 3 * h * arch.moe_intermediate_size
    shared = 3 * h * arch.shared_expert_intermediate_size
    return experts + shared + h * arch.num_experts


def _layer_params(arch: ModelArch, index: int) -> int:
    """One decoder layer's parameters: attention, its two norms, and a dense MLP or the expert block."""
    h = arch.hidden_size
    is_moe = arch.is_moe and index >= arch.first_k_dense_replace and index % arch.moe_layer_freq == 0
    mlp = _moe_block_params(arch) if is_moe else 3 * h * arch.intermediate_size
    return _attention_params(arch) + 2 * h + mlp


def param_count(arch: ModelArch) -> int:
    """Parameters of the main model, estimated from its config.

    Counts embeddings, an untied lm_head, attention (MLA projections and latent norms included),
    gated (SwiGLU) MLPs, MoE experts, shared experts and routers, dense-first layers, and RMSNorm
    weights. Multi-token-prediction modules (DeepSeek-V3's extra 14B) are not part of the main model.
    """
    h = arch.hidden_size
    moe_layers = arch.moe_layers
    dense_layers = arch.num_layers - moe_layers
    per_layer = _attention_params(arch) + 2 * h  # input and post-attention norms
    total = _embedding_params(arch) + h  # final norm
    total += arch.num_layers * per_layer
    total += dense_layers * 3 * h * arch.intermediate_size
    total += moe_layers * _moe_block_params(arch)
    return total


# -- weight bytes ----------------------------------------------------------------------------------


def _norm(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def bytes_per_param(dtype: str, quantization: str | None) -> float:
    """Bytes one parameter takes: by ``quantization`` when given, else by ``dtype``.

    bf16/fp16 2, fp32 4, fp8/int8 1, int4 (AWQ/GPTQ) ~0.52 with group-128 scales and zero points,
    MXFP4 ~0.53, NVFP4 ~0.56. Raises ValueError naming the accepted values.
    """
    if quantization is not None:
        method = _norm(quantization)
        if method not in _QUANT_BYTES:
            raise ValueError(f"unknown quantization {quantization!r}; accepted: {', '.join(sorted(_QUANT_BYTES))}")
        if _norm(dtype) not in _DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; accepted: {', '.join(_DTYPE_BYTES)}")
        return _QUANT_BYTES[method]
    size = _DTYPE_BYTES.get(_norm(dtype))
    if size is None:
        raise ValueError(f"unknown dtype {dtype!r}; accepted: {', '.join(_DTYPE_BYTES)}")
    return float(size)


def _resolve_dtype(dtype: str, arch: ModelArch) -> str:
    """``auto`` -> the checkpoint's dtype; float32 checkpoints are served in 16 bits, as vLLM does."""
    if _norm(dtype) != "auto":
        return dtype
    native = _norm(arch.torch_dtype or "bfloat16")
    return "bfloat16" if _DTYPE_BYTES.get(native) == 4 else native


def safetensors_total_size(model_dir: Path) -> int | None:
    """Exact tensor bytes of a local checkpoint, or None when it cannot be told without loading it.

    Reads ``metadata.total_size`` of ``model.safetensors.index.json``; for a single-file
    ``model.safetensors`` without an index, the file size less its header.
    """
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            data: Any = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelConfigError(f"{index}: cannot read the safetensors index: {exc}") from exc
        total = data.get("metadata", {}).get("total_size") if isinstance(data, dict) else None
        return int(total) if isinstance(total, (int, float)) and not isinstance(total, bool) else None
    single = model_dir / "model.safetensors"
    if single.is_file():
        with single.open("rb") as f:
            head = f.read(8)
        if len(head) == 8:
            (header_len,) = struct.unpack("<Q", head)
            size = single.stat().st_size - 8 - header_len
            return size if size >= 0 else None
    return None


def weight_bytes(
    arch: ModelArch, dtype: str = "auto", quantization: str | None = None, exact_total: int | None = None
) -> int:
    """Bytes of the model's weights across all GPUs.

    ``exact_total`` (e.g. from `safetensors_total_size`) wins when given. Otherwise the estimate is
    `param_count` x `bytes_per_param`. ``quantization`` None takes the checkpoint's own method from
    its ``quantization_config``, as vLLM does; a quantized model keeps its embeddings and lm_head
    at the 16-bit ``dtype``. ``dtype`` ``auto`` is the checkpoint's dtype.
    """
    if exact_total is not None:
        if exact_total < 0:
            raise ValueError(f"exact_total must be >= 0, got {exact_total}")
        return exact_total
    dtype = _resolve_dtype(dtype, arch)
    method = quantization if quantization is not None else arch.quant_method
    total = param_count(arch)
    if method is None:
        return math.ceil(total * bytes_per_param(dtype, None))
    kept = _embedding_params(arch)
    return math.ceil((total - kept) * bytes_per_param(dtype, method) + kept * bytes_per_param(dtype, None))


def stage_layers(num_layers: int, pp: int) -> list[int]:
    """Decoder layers on each of ``pp`` stages, as vLLM splits them: evenly, the remainder one each to the
    stages before the last, the latest first (``get_pp_indices``)."""
    if pp < 1 or num_layers < pp:
        raise ValueError(f"expected 1 <= pp <= {num_layers} layers, got pp={pp}")
    layers = [num_layers // pp] * pp
    for k in range(num_layers % pp):
        layers[-2 - k] += 1
    return layers


def stage_weights_per_gpu(arch: ModelArch, total_weight_bytes: int, tp: int, pp: int, dtype: str = "auto"
                          ) -> list[int]:
    """Weight bytes on one GPU of each pipeline stage (rounded up).

    The decoder layers share what the embedding tables leave of ``total_weight_bytes`` by their parameter
    counts (dense-first MoE layers are smaller). The first stage adds the input embedding, the last the
    output head: a separate table, or with PP > 1 its own copy of a tied one. Tables stay at the 16-bit
    ``dtype`` in quantized models, as vLLM keeps them; everything is split by TP.
    """
    _check_parallel(tp, pp)
    if total_weight_bytes < 0:
        raise ValueError(f"total_weight_bytes must be >= 0, got {total_weight_bytes}")
    row = arch.hidden_size * bytes_per_param(_resolve_dtype(dtype, arch), None)
    table = _padded_vocab(arch) * row  # as allocated; the checkpoint holds vocab_size rows
    tables_in_total = arch.vocab_size * row * (1 if arch.tie_word_embeddings else 2)
    layer_params = [_layer_params(arch, i) for i in range(arch.num_layers)]
    per_param = max(0.0, total_weight_bytes - tables_in_total) / (sum(layer_params) + arch.hidden_size)
    out: list[int] = []
    start = 0
    for stage, count in enumerate(stage_layers(arch.num_layers, pp)):
        params = sum(layer_params[start:start + count])
        start += count
        size = params * per_param
        if stage == 0:
            size += table
        if stage == pp - 1:
            size += arch.hidden_size * per_param  # the final norm
            if not arch.tie_word_embeddings or pp > 1:
                size += table
        out.append(math.ceil(size / tp))
    return out


# -- LoRA slots -----------------------------------------------------------------------------------

LORA_PART = "LoRA slots"  # the reserve's part that holds them (KvBudget.reserve_parts)


def lora_modelled(arch: ModelArch) -> bool:
    """Whether :func:`lora_slot_bytes` models this architecture's LoRA slots: dense attention models (an MoE's
    experts and MLA's latent projections get slots of their own shapes, not modelled)."""
    return not arch.is_moe and not arch.is_mla


def lora_slot_bytes(arch: ModelArch, *, max_loras: int, rank: int, dtype_bytes: int, tp: int = 1, pp: int = 1,
                    stage: int = 0) -> int:
    """What ``--enable-lora`` allocates on one GPU of pipeline stage ``stage``, before the KV cache is sized: for
    each of ``max_loras`` slots, an A (``rank`` x in) and a B (out x ``rank``) matrix of every linear layer of the
    stage's decoder layers, in the model's dtype: q/k/v and gate/up (column parallel: an A per part, whole; B
    split over ``tp``), o and down (row parallel: A split, B whole); and on the first stage the input embedding's,
    on the last the LM head's (the whole vocabulary). vLLM 0.31's LoRA layers (``create_lora_weights``)."""
    _check_parallel(tp, pp)
    if max_loras < 1 or rank < 1:
        raise ValueError(f"max_loras and rank must be >= 1, got {max_loras} and {rank}")
    h, inter = arch.hidden_size, arch.intermediate_size
    q_out = arch.num_attention_heads * arch.head_dim
    kv_out = max(1, arch.num_kv_heads // tp) * arch.head_dim  # per GPU: KV heads are copied below one a GPU
    a = 3 * h + 2 * h + q_out // tp + inter // tp  # qkv, gate_up (whole), o, down (split)
    b = q_out // tp + 2 * kv_out + 2 * inter // tp + h + h  # qkv, gate_up (split), o, down (whole)
    elements = stage_layers(arch.num_layers, pp)[stage] * rank * (a + b)
    if stage == 0:
        elements += rank * (arch.vocab_size + h)  # the input embedding's
    if stage == pp - 1:
        elements += rank * (h + arch.vocab_size)  # the LM head's
    return max_loras * elements * dtype_bytes


# -- KV cache --------------------------------------------------------------------------------------


def _check_parallel(tp: int, pp: int) -> None:
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")


def _kv_element_bytes(kv_dtype: str, model_dtype: str, arch: ModelArch) -> int:
    kv = _norm(kv_dtype)
    if kv not in _KV_DTYPES:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}; accepted: {', '.join(_KV_DTYPES)}")
    if kv.startswith("fp8"):
        return 1
    name = _resolve_dtype(model_dtype, arch) if kv == "auto" else kv
    size = _DTYPE_BYTES.get(_norm(name))
    if size is None:
        raise ValueError(f"unknown model_dtype {model_dtype!r}; accepted: auto, {', '.join(_DTYPE_BYTES)}")
    return size


def kv_bytes_per_token(
    arch: ModelArch, kv_dtype: str = "auto", model_dtype: str = "bfloat16", tp: int = 1, pp: int = 1,
    stage: int | None = None, mla_entry_align_bytes: int = 1,
) -> int:
    """KV-cache bytes one token takes on one GPU of pipeline stage ``stage`` (None: the fullest stage).

    A stage holds its `stage_layers` (the fullest ``ceil(num_layers / pp)``). Standard attention splits KV
    heads by TP (at least one per GPU); MLA keeps the whole latent on every GPU, each layer's entry rounded
    up to ``mla_entry_align_bytes``.
    """
    _check_parallel(tp, pp)
    element = _kv_element_bytes(kv_dtype, model_dtype, arch)
    layers = math.ceil(arch.num_layers / pp) if stage is None else stage_layers(arch.num_layers, pp)[stage]
    if arch.is_mla:
        entry = ((arch.kv_lora_rank or 0) + (arch.qk_rope_head_dim or 0)) * element
        return layers * -(-entry // mla_entry_align_bytes) * mla_entry_align_bytes
    heads = max(1, arch.num_kv_heads // tp)
    return 2 * layers * heads * arch.head_dim * element


def kv_tokens_per_sequence(arch: ModelArch, max_model_len: int) -> int:
    """Tokens of KV cache one sequence at ``max_model_len`` holds.

    When every layer uses a sliding window the cache is capped at the window. This is a slight
    underestimate: vLLM keeps the window plus the tokens still being computed (a prefill chunk).
    Models mixing window and full layers are counted at the full length (conservative).
    """
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    if arch.all_layers_sliding and arch.sliding_window is not None:
        return min(max_model_len, arch.sliding_window)
    return max_model_len


def _size(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


@dataclass(frozen=True)
class KvBudget:
    """The KV pool of one GPU (of the pipeline stage that sizes the cache) and how many full-length sequences
    it holds.

    ``kv_pool_bytes`` is negative when weights and reserve exceed the usable memory; ``kv_tokens``
    and ``max_concurrency`` are then 0. The pool is counted in whole blocks of ``block_size`` tokens, as vLLM
    allocates it; ``max_concurrency`` is a float, as in vLLM's own "Maximum concurrency for N tokens per
    request: X.XXx" log line (blocks over the blocks one sequence needs); `full_sequences` is its floor.
    ``kv_space_bytes`` is set on vLLM's CPU build, whose pool is ``VLLM_CPU_KVCACHE_SPACE`` (weights and
    reserve then live beside it in RAM). ``kv_margin``: the share of the pool kept out of ``kv_tokens``.
    """

    gpu_memory_bytes: int
    gpu_memory_utilization: float
    usable_bytes: int
    weights_bytes_per_gpu: int
    reserve_bytes: int
    kv_pool_bytes: int
    kv_bytes_per_token: int
    tokens_per_sequence: int
    kv_tokens: int
    max_concurrency: float
    block_size: int = 1
    stage: int = 0
    stages: int = 1
    reserve_parts: tuple[tuple[str, int], ...] = ()
    kv_space_bytes: int | None = None
    kv_margin: float = 0.0
    kv_cache_bytes: int | None = None  # --kv-cache-memory-bytes: the pool's fixed size

    @property
    def full_sequences(self) -> int:
        """Sequences at full length that fit at once."""
        return math.floor(self.max_concurrency)

    def sequences_at(self, tokens: int) -> int:
        """Sequences of ``tokens`` tokens each (prompt and answer) that fit at once, in whole blocks as vLLM
        allocates them (at ``tokens_per_sequence``: :attr:`full_sequences`)."""
        if self.kv_tokens <= 0 or tokens < 1:
            return 0
        return (self.kv_tokens // self.block_size) // math.ceil(tokens / self.block_size)

    @property
    def lora_counted(self) -> bool:
        """Whether the reserve counts LoRA slots (``--enable-lora`` on a dense model, on GPUs)."""
        return any(name == LORA_PART for name, _ in self.reserve_parts)

    @property
    def fits(self) -> bool:
        """At least one sequence at full length fits."""
        return self.full_sequences >= 1

    def _first_line(self) -> str:
        where = f"stage {self.stage + 1} of {self.stages}: " if self.stages > 1 else ""
        if self.kv_space_bytes is not None:
            return (f"{where}VLLM_CPU_KVCACHE_SPACE {_size(self.kv_space_bytes)} = {_size(self.kv_pool_bytes)}"
                    f" KV pool (weights {_size(self.weights_bytes_per_gpu)} beside it in RAM)")
        parts = ", ".join(f"{name} {size / GIB:,.2f}" for name, size in self.reserve_parts)
        if self.kv_cache_bytes is not None:
            return (f"{where}--kv-cache-memory-bytes {_size(self.kv_cache_bytes)} KV pool beside"
                    f" {_size(self.weights_bytes_per_gpu)} weights and {_size(self.reserve_bytes)} reserve"
                    f"{f' ({parts})' if parts else ''} in {_size(self.gpu_memory_bytes)}")
        return (f"{where}{_size(self.gpu_memory_bytes)} x {self.gpu_memory_utilization:g} = {_size(self.usable_bytes)}"
                f" usable; - {_size(self.weights_bytes_per_gpu)} weights; - {_size(self.reserve_bytes)} reserve"
                f"{f' ({parts})' if parts else ''} = {_size(self.kv_pool_bytes)} KV pool")

    def lines(self) -> list[str]:
        """The arithmetic, one step per line, for reports."""
        out = [self._first_line()]
        if self.kv_pool_bytes <= 0:
            what = "weights, reserve and that pool exceed the GPU's memory" if self.kv_cache_bytes is not None else (
                "weights and reserve exceed usable memory")
            out.append(f"no KV pool: {what} by {_size(-self.kv_pool_bytes)}")
            return out
        blocks = f" in blocks of {self.block_size}" if self.block_size > 1 else ""
        margin = f" x (1 - {self.kv_margin:g} margin)" if self.kv_margin else ""
        out.append(
            f"{_size(self.kv_pool_bytes)}{margin} / {self.kv_bytes_per_token:,} B"
            f" ({self.kv_bytes_per_token / 1024:,.1f} KiB)"
            f" per token{blocks} = {self.kv_tokens:,} tokens"
        )
        out.append(
            f"{self.kv_tokens:,} tokens / {self.tokens_per_sequence:,} per sequence "
            f"= {self.max_concurrency:.2f} sequences at full length"
        )
        return out


def _sized(pool: int, kv_bytes_per_token: int, tokens_per_sequence: int, block_size: int) -> tuple[int, float]:
    """(tokens, sequences at full length) of a pool counted in whole blocks, as vLLM counts them."""
    if kv_bytes_per_token < 1 or tokens_per_sequence < 1 or block_size < 1:
        raise ValueError("kv_bytes_per_token, tokens_per_sequence and block_size must be >= 1")
    blocks = pool // (kv_bytes_per_token * block_size) if pool > 0 else 0
    return blocks * block_size, blocks / -(-tokens_per_sequence // block_size)


def kv_budget(
    gpu_memory_bytes: int,
    gpu_memory_utilization: float,
    weights_bytes_per_gpu: int,
    reserve_bytes: int,
    kv_bytes_per_token: int,
    tokens_per_sequence: int,
    *,
    block_size: int = 1,
    reserve_parts: tuple[tuple[str, int], ...] = (),
    stage: int = 0,
    stages: int = 1,
    kv_margin: float = 0.0,
) -> KvBudget:
    """Work out one GPU's KV pool: ``memory x utilization - weights - reserve``, then tokens and sequences of
    ``pool x (1 - kv_margin)`` in whole blocks."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if not 0 <= kv_margin < 1:
        raise ValueError(f"kv_margin must be in [0, 1), got {kv_margin}")
    if min(gpu_memory_bytes, weights_bytes_per_gpu, reserve_bytes) < 0:
        raise ValueError("memory, weight and reserve sizes must be >= 0")
    usable = int(gpu_memory_bytes * gpu_memory_utilization)
    pool = usable - weights_bytes_per_gpu - reserve_bytes
    planned = math.floor(pool * (1 - kv_margin)) if pool > 0 else pool
    tokens, sequences = _sized(planned, kv_bytes_per_token, tokens_per_sequence, block_size)
    return KvBudget(
        gpu_memory_bytes=gpu_memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        usable_bytes=usable,
        weights_bytes_per_gpu=weights_bytes_per_gpu,
        reserve_bytes=reserve_bytes,
        kv_pool_bytes=pool,
        kv_bytes_per_token=kv_bytes_per_token,
        tokens_per_sequence=tokens_per_sequence,
        kv_tokens=tokens,
        max_concurrency=sequences,
        block_size=block_size,
        stage=stage,
        stages=stages,
        reserve_parts=reserve_parts,
        kv_margin=kv_margin,
    )


def kv_fixed_budget(gpu_memory_bytes: int, kv_cache_bytes: int, weights_bytes_per_gpu: int, reserve_bytes: int,
                    kv_bytes_per_token: int, tokens_per_sequence: int, *, block_size: int,
                    reserve_parts: tuple[tuple[str, int], ...] = (), stage: int = 0, stages: int = 1) -> KvBudget:
    """A KV pool of exactly ``kv_cache_bytes`` (vLLM's ``--kv-cache-memory-bytes``, which sets aside
    gpu_memory_utilization): it fits when weights, reserve and the pool fit the GPU's memory; else the pool is
    minus what they exceed it by."""
    if min(gpu_memory_bytes, kv_cache_bytes, weights_bytes_per_gpu, reserve_bytes) < 0:
        raise ValueError("memory, pool, weight and reserve sizes must be >= 0")
    over = weights_bytes_per_gpu + reserve_bytes + kv_cache_bytes - gpu_memory_bytes
    pool = kv_cache_bytes if over <= 0 else -over
    tokens, sequences = _sized(pool, kv_bytes_per_token, tokens_per_sequence, block_size)
    return KvBudget(
        gpu_memory_bytes=gpu_memory_bytes, gpu_memory_utilization=1.0, usable_bytes=gpu_memory_bytes,
        weights_bytes_per_gpu=weights_bytes_per_gpu, reserve_bytes=reserve_bytes, kv_pool_bytes=pool,
        kv_bytes_per_token=kv_bytes_per_token, tokens_per_sequence=tokens_per_sequence, kv_tokens=tokens,
        max_concurrency=sequences, block_size=block_size, stage=stage, stages=stages, reserve_parts=reserve_parts,
        kv_cache_bytes=kv_cache_bytes,
    )


def kv_space_budget(kv_space_bytes: int, weights_bytes_per_gpu: int, kv_bytes_per_token: int,
                    tokens_per_sequence: int, *, block_size: int, stage: int = 0, stages: int = 1) -> KvBudget:
    """The KV pool of one worker of vLLM's CPU build: exactly ``kv_space_bytes`` (VLLM_CPU_KVCACHE_SPACE)."""
    if kv_space_bytes < 0:
        raise ValueError("the KV space must be >= 0")
    tokens, sequences = _sized(kv_space_bytes, kv_bytes_per_token, tokens_per_sequence, block_size)
    return KvBudget(
        gpu_memory_bytes=kv_space_bytes, gpu_memory_utilization=1.0, usable_bytes=kv_space_bytes,
        weights_bytes_per_gpu=weights_bytes_per_gpu, reserve_bytes=0, kv_pool_bytes=kv_space_bytes,
        kv_bytes_per_token=kv_bytes_per_token, tokens_per_sequence=tokens_per_sequence, kv_tokens=tokens,
        max_concurrency=sequences, block_size=block_size, stage=stage, stages=stages,
        kv_space_bytes=kv_space_bytes,
    )


def model_info(
    arch: ModelArch, kv_dtype: str = "auto", model_dtype: str = "bfloat16", tp: int = 1, pp: int = 1
) -> dict[str, Any]:
    """The facts ``gpufleet`` prints about a model, as plain JSON-ready values."""
    return {
        "model_type": arch.model_type,
        "num_layers": arch.num_layers,
        "num_kv_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "param_count": param_count(arch),
        "kv_bytes_per_token": kv_bytes_per_token(arch, kv_dtype, model_dtype, tp, pp),
        "is_moe": arch.is_moe,
        "is_mla": arch.is_mla,
    }
