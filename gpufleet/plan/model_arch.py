"""Model architecture as read from a Hugging Face ``config.json``.

`load_arch` accepts a path to a ``config.json``, a model directory holding one, or the name of a
bundled config (``gpufleet/data/model_configs/``), e.g. ``meta-llama/Llama-3.1-70B-Instruct``.
The result, `ModelArch`, holds only what the memory math in `gpufleet.plan.model_memory` needs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = [
    "ModelArch",
    "ModelConfigError",
    "arch_from_config",
    "bundled_models",
    "load_arch",
]

CONFIG_NAME = "config.json"
_REQUIRED_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
# model_type values whose q/k/v projections carry a bias even without `attention_bias` in the config
_QKV_BIAS_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl"})


class ModelConfigError(ValueError):
    """A model config that cannot be read: missing file, bad JSON, missing or invalid keys."""


@dataclass(frozen=True)
class ModelArch:
    """Architecture facts from one ``config.json``.

    Optional families are off when their fields are at their defaults: MoE when ``num_experts``
    is 0, MLA when ``kv_lora_rank`` is None, sliding window when ``sliding_window`` is None.
    """

    name: str  # the bundled model's name, or the path of the config file read
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None
    torch_dtype: str | None = None
    architectures: tuple[str, ...] = ()
    attention_bias: bool = False
    # Mixture of experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    # Multi-head latent attention (DeepSeek-V2/V3)
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    # Sliding-window attention: the window and the indices of the layers that use it
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] = ()
    # Multi-token-prediction modules shipped beside the main model (not counted as its parameters)
    num_mtp_layers: int = 0
    quantization_config: Mapping[str, Any] | None = field(default=None, hash=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def all_layers_sliding(self) -> bool:
        """True when every layer attends only within ``sliding_window``."""
        return self.sliding_window is not None and len(self.sliding_window_layers) == self.num_layers

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is the expert block (the rest are dense)."""
        if not self.is_moe:
            return 0
        return sum(
            1
            for i in range(self.first_k_dense_replace, self.num_layers)
            if i % self.moe_layer_freq == 0
        )

    @property
    def checkpoint_quant_method(self) -> str | None:
        """``quantization_config.quant_method`` as written (lower case, ``-`` as ``_``), or None: what vLLM compares
        ``--quantization`` with."""
        method = (self.quantization_config or {}).get("quant_method")
        return str(method).strip().lower().replace("-", "_") or None if method else None

    @property
    def quant_method(self) -> str | None:
        """The checkpoint's quantization, normalised to a name `bytes_per_param` knows, or None.

        ``compressed-tensors`` and GPTQ/bitsandbytes are resolved by their bit width; an unknown
        method is returned as written (lower case) so the caller can report it.
        """
        qc = self.quantization_config
        if not qc:
            return None
        method = str(qc.get("quant_method", "")).lower().replace("-", "_") or None
        if method == "compressed_tensors":
            return _compressed_tensors_method(qc)
        if method == "gptq" and qc.get("bits") == 8:
            return "int8"
        if method == "bitsandbytes":
            return "int8" if qc.get("load_in_8bit") else "int4"
        return method


def _compressed_tensors_method(qc: Mapping[str, Any]) -> str | None:
    """fp8 / int8 / int4 from the weight scheme of the first ``config_groups`` entry."""
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping):
        return None
    for group in groups.values():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if not isinstance(weights, Mapping):
            continue
        bits, kind = weights.get("num_bits"), weights.get("type")
        if bits == 8:
            return "fp8" if kind == "float" else "int8"
        if bits == 4:
            return "nvfp4" if kind == "float" else "int4"
    return None


def _int(cfg: Mapping[str, Any], key: str, origin: str, minimum: int = 1) -> int | None:
    """``cfg[key]`` as an int of at least ``minimum``, None when absent or null."""
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ModelConfigError(f"{origin}: '{key}' must be {kind}, got {value!r}")
    return value


def _count(cfg: Mapping[str, Any], key: str, origin: str) -> int:
    """An optional count that may be 0 (experts, dense-first layers, MTP modules)."""
    return _int(cfg, key, origin, minimum=0) or 0


def _sliding_layers(cfg: Mapping[str, Any], num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """The window and the layers that use it, following each family's config convention."""
    window = cfg.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        return None, ()
    qwen_style = "use_sliding_window" in cfg or "max_window_layers" in cfg
    if qwen_style and not cfg.get("use_sliding_window"):  # Qwen2/2.5: present but switched off
        return None, ()
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list):
        layers = tuple(i for i, t in enumerate(layer_types[:num_layers]) if "sliding" in str(t))
    elif qwen_style and isinstance(cfg.get("max_window_layers"), int):  # layers from there on
        layers = tuple(range(cfg["max_window_layers"], num_layers))
    elif isinstance(cfg.get("sliding_window_pattern"), int):  # Gemma 3: every Nth layer is global
        pattern = cfg["sliding_window_pattern"]
        layers = tuple(i for i in range(num_layers) if (i + 1) % pattern != 0)
    elif cfg.get("model_type") == "gemma2":  # alternating, starting with a sliding layer
        layers = tuple(range(0, num_layers, 2))
    else:  # Mistral-7B-v0.1 and friends: every layer
        layers = tuple(range(num_layers))
    return (window, layers) if layers else (None, ())


def arch_from_config(cfg: Mapping[str, Any], origin: str = CONFIG_NAME) -> ModelArch:
    """Build a `ModelArch` from a parsed config; ``origin`` names the source in error messages."""
    if not isinstance(cfg, Mapping):
        raise ModelConfigError(f"{origin}: expected a JSON object, got {type(cfg).__name__}")
    text = cfg.get("text_config")
    if "num_hidden_layers" not in cfg and isinstance(text, Mapping):
        cfg = {**cfg, **text}  # multimodal wrappers keep the language model in text_config
    missing = [k for k in _REQUIRED_KEYS if cfg.get(k) is None]
    num_experts = next(
        (n for k in ("num_local_experts", "n_routed_experts", "num_experts") if (n := _count(cfg, k, origin))), 0
    )
    if cfg.get("intermediate_size") is None and not (num_experts and cfg.get("moe_intermediate_size")):
        missing.append("intermediate_size")
    if missing:
        raise ModelConfigError(f"{origin}: missing required key(s): {', '.join(missing)}")

    layers = _int(cfg, "num_hidden_layers", origin) or 0
    hidden = _int(cfg, "hidden_size", origin) or 0
    heads = _int(cfg, "num_attention_heads", origin) or 0
    intermediate = _int(cfg, "intermediate_size", origin) or 0
    model_type = str(cfg.get("model_type") or "unknown")
    kv_lora_rank = _int(cfg, "kv_lora_rank", origin)
    qk_nope = _int(cfg, "qk_nope_head_dim", origin)
    qk_rope = _int(cfg, "qk_rope_head_dim", origin)
    if kv_lora_rank is not None and (qk_nope is None or qk_rope is None):
        raise ModelConfigError(f"{origin}: MLA config (kv_lora_rank) needs qk_nope_head_dim and qk_rope_head_dim")
    if qk_nope is not None and qk_rope is not None:
        head_dim = qk_nope + qk_rope  # MLA: the q/k head (hidden / heads means nothing there)
    else:
        head_dim = _int(cfg, "head_dim", origin) or hidden // heads
    moe = bool(num_experts)
    # Mixtral has no moe_intermediate_size: every expert is a full-size MLP
    moe_inter = (_int(cfg, "moe_intermediate_size", origin) or intermediate) if moe else 0
    n_shared = _count(cfg, "n_shared_experts", origin) if moe else 0
    shared_inter = (_count(cfg, "shared_expert_intermediate_size", origin) or n_shared * moe_inter) if moe else 0
    window, window_layers = _sliding_layers(cfg, layers)
    quant = cfg.get("quantization_config")
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    return ModelArch(
        name=origin,
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_kv_heads=_int(cfg, "num_key_value_heads", origin) or heads,
        head_dim=head_dim,
        vocab_size=_int(cfg, "vocab_size", origin) or 0,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=_int(cfg, "max_position_embeddings", origin),
        torch_dtype=str(dtype) if dtype else None,
        architectures=tuple(str(a) for a in cfg.get("architectures") or ()),
        attention_bias=bool(cfg.get("attention_bias")) or model_type in _QKV_BIAS_TYPES,
        num_experts=num_experts,
        num_experts_per_tok=_count(cfg, "num_experts_per_tok", origin) if moe else 0,
        moe_intermediate_size=moe_inter,
        num_shared_experts=n_shared,
        shared_expert_intermediate_size=shared_inter,
        first_k_dense_replace=_count(cfg, "first_k_dense_replace", origin) if moe else 0,
        moe_layer_freq=_int(cfg, "moe_layer_freq", origin) or 1,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=_int(cfg, "q_lora_rank", origin),
        qk_rope_head_dim=qk_rope,
        qk_nope_head_dim=qk_nope,
        v_head_dim=_int(cfg, "v_head_dim", origin),
        sliding_window=window,
        sliding_window_layers=window_layers,
        num_mtp_layers=_count(cfg, "num_nextn_predict_layers", origin),
        quantization_config=dict(quant) if isinstance(quant, Mapping) else None,
    )


def _bundled_dir() -> Path:
    return Path(str(resources.files("gpufleet") / "data" / "model_configs"))


def bundled_models() -> list[str]:
    """Names of the bundled configs, e.g. ``Llama-3.1-70B``."""
    return sorted(p.stem for p in _bundled_dir().glob("*.json"))


def _normalise(name: str) -> str:
    """Lower case, no org prefix, no ``Meta-`` prefix, no ``-Instruct`` / ``-Base`` variant tag."""
    name = name.strip().rsplit("/", 1)[-1].lower()
    name = name.removeprefix("meta-")
    return re.sub(r"-(instruct|base)(?=-|$)", "", name)


def _bundled_path(name: str) -> Path | None:
    wanted = _normalise(name)
    for stem in bundled_models():
        if _normalise(stem) == wanted:
            return _bundled_dir() / f"{stem}.json"
    return None


def _read_config(path: Path, label: str) -> ModelArch:
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from exc
    arch = arch_from_config(cfg, str(path))
    return arch if label == arch.name else replace(arch, name=label)


def load_arch(source: str | Path) -> ModelArch:
    """Read a model's architecture from a config file, a model directory, or a bundled name.

    An existing path wins over a bundled name. Raises `ModelConfigError` with the file and the
    problem (missing file, bad JSON, missing or invalid keys).
    """
    path = Path(source).expanduser()
    if path.is_dir():
        config = path / CONFIG_NAME
        if not config.is_file():
            raise ModelConfigError(f"{path}: model directory has no {CONFIG_NAME}")
        return _read_config(config, str(config))
    if path.is_file():
        return _read_config(path, str(path))
    bundled = _bundled_path(str(source))
    if bundled is not None:
        return _read_config(bundled, bundled.stem)
    raise ModelConfigError(
        f"{source}: no such file or directory, and not a bundled model "
        f"(bundled: {', '.join(bundled_models())})"
    )
