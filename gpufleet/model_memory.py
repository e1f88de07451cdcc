"""Memory math for serving a model with vLLM: parameters, weight bytes, KV cache per token, the KV pool.

The KV rules follow vLLM (``vllm/v1/kv_cache_interface.py``, ``config/model.py``):

- standard attention, per token per GPU: ``2 x layers_on_stage x max(1, kv_heads // tp) x head_dim x bytes``
  (K and V; KV heads are replicated when TP exceeds them);
- MLA (DeepSeek-V2/V3): one latent of ``kv_lora_rank + qk_rope_head_dim`` per layer, not split by TP;
- ``fp8*`` KV cache dtypes take 1 byte per element, ``auto`` takes the model dtype;
- the pool is ``utilization x GPU memory - weights on that GPU - activation/CUDA-graph reserve``.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet.model_arch import ModelArch, ModelConfigError

__all__ = [
    "KvBudget",
    "bytes_per_param",
    "kv_budget",
    "kv_bytes_per_token",
    "kv_tokens_per_sequence",
    "model_info",
    "param_count",
    "safetensors_total_size",
    "weight_bytes",
    "weights_bytes_per_gpu",
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


def _moe_block_params(arch: ModelArch) -> int:
    """One MoE layer's MLP: routed experts, shared experts, router."""
    h = arch.hidden_size
    experts = arch.num_experts * 3 * h * arch.moe_intermediate_size
    shared = 3 * h * arch.shared_expert_intermediate_size
    return experts + shared + h * arch.num_experts


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


def weights_bytes_per_gpu(total_weight_bytes: int, tp: int, pp: int) -> int:
    """An even share of the weights per GPU (rounded up).

    Approximate: the embedding and lm_head sit on the first and last pipeline stages and layers may
    not divide evenly between stages, so the fullest GPU can hold a little more than this.
    """
    _check_parallel(tp, pp)
    if total_weight_bytes < 0:
        raise ValueError(f"total_weight_bytes must be >= 0, got {total_weight_bytes}")
    return math.ceil(total_weight_bytes / (tp * pp))


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
    arch: ModelArch, kv_dtype: str = "auto", model_dtype: str = "bfloat16", tp: int = 1, pp: int = 1
) -> int:
    """KV-cache bytes one token takes on one GPU of the fullest pipeline stage.

    That stage holds ``ceil(num_layers / pp)`` layers. Standard attention splits KV heads by TP
    (at least one per GPU); MLA keeps the whole latent on every GPU.
    """
    _check_parallel(tp, pp)
    element = _kv_element_bytes(kv_dtype, model_dtype, arch)
    layers = math.ceil(arch.num_layers / pp)
    if arch.is_mla:
        return layers * ((arch.kv_lora_rank or 0) + (arch.qk_rope_head_dim or 0)) * element
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
    """The KV pool of one GPU and how many full-length sequences it holds.

    ``kv_pool_bytes`` is negative when weights and reserve exceed the usable memory; ``kv_tokens``
    and ``max_concurrency`` are then 0. ``max_concurrency`` is a float, as in vLLM's own
    "Maximum concurrency for N tokens per request: X.XXx" log line; `full_sequences` is its floor.
    ``kv_tokens`` is not rounded down to whole 16-token blocks (vLLM's differs by fewer than 16).
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

    @property
    def full_sequences(self) -> int:
        """Sequences at full length that fit at once."""
        return math.floor(self.max_concurrency)

    @property
    def fits(self) -> bool:
        """At least one sequence at full length fits."""
        return self.full_sequences >= 1

    def lines(self) -> list[str]:
        """The arithmetic, one step per line, for reports."""
        out = [
            f"{_size(self.gpu_memory_bytes)} x {self.gpu_memory_utilization:g} = {_size(self.usable_bytes)} usable; "
            f"- {_size(self.weights_bytes_per_gpu)} weights; - {_size(self.reserve_bytes)} reserve "
            f"= {_size(self.kv_pool_bytes)} KV pool"
        ]
        if self.kv_pool_bytes <= 0:
            out.append(
                f"no KV pool: weights and reserve exceed usable memory by {_size(-self.kv_pool_bytes)}"
            )
            return out
        out.append(
            f"{_size(self.kv_pool_bytes)} / {self.kv_bytes_per_token:,} B ({self.kv_bytes_per_token / 1024:,.1f} KiB)"
            f" per token = {self.kv_tokens:,} tokens"
        )
        out.append(
            f"{self.kv_tokens:,} tokens / {self.tokens_per_sequence:,} per sequence "
            f"= {self.max_concurrency:.2f} sequences at full length"
        )
        return out


def kv_budget(
    gpu_memory_bytes: int,
    gpu_memory_utilization: float,
    weights_bytes_per_gpu: int,
    reserve_bytes: int,
    kv_bytes_per_token: int,
    tokens_per_sequence: int,
) -> KvBudget:
    """Work out one GPU's KV pool: ``memory x utilization - weights - reserve``, then tokens and sequences."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if kv_bytes_per_token < 1 or tokens_per_sequence < 1:
        raise ValueError("kv_bytes_per_token and tokens_per_sequence must be >= 1")
    if min(gpu_memory_bytes, weights_bytes_per_gpu, reserve_bytes) < 0:
        raise ValueError("memory, weight and reserve sizes must be >= 0")
    usable = int(gpu_memory_bytes * gpu_memory_utilization)
    pool = usable - weights_bytes_per_gpu - reserve_bytes
    tokens = pool // kv_bytes_per_token if pool > 0 else 0
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
        max_concurrency=tokens / tokens_per_sequence,
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
