"""What vLLM refuses of a quantization: one that contradicts the checkpoint's, and fp8 on a GPU without it.

- ``--quantization`` against the checkpoint's ``quantization_config.quant_method`` (vLLM's ``ModelConfig``):
  the same method, or a kernel of the same format (``awq_marlin`` for an AWQ checkpoint, ``gptq_marlin`` for a
  GPTQ one, ``modelopt_fp4`` for a ModelOpt one), else vLLM stops at start. On an unquantized checkpoint only
  ``fp8`` is quantized while loading (online); any other method expects tensors the checkpoint lacks.
- fp8 by compute capability (vLLM's FP8 W8A8 page): fp8 compute needs 8.9 (Ada, Hopper and newer). fp8
  *weights* run weight-only (W8A16, FP8 Marlin) from 7.5 (Turing, Ampere): accepted below 8.9 with a warning.
  An fp8 *KV cache* is stored in fp8 and converted in software below 8.9 (vLLM's fp8 cache was proven on Volta
  and Ampere when it was added): accepted from 7.0, vLLM's least, with a warning below 8.9 (it holds twice the
  tokens and speeds nothing up, and vLLM must pick an attention backend that has an fp8 cache on that GPU).
"""

from __future__ import annotations

FP8_COMPUTE = (8, 9)
"""The least compute capability with fp8 in hardware (Ada Lovelace 8.9, Hopper 9.0)."""
FP8_MARLIN = (7, 5)
"""The least compute capability on which vLLM runs fp8 weights weight-only (FP8 Marlin)."""
FP8_KV_SOFTWARE = (7, 0)
"""The least compute capability on which vLLM keeps an fp8 KV cache (converted in software below 8.9)."""

ONLINE = frozenset({"fp8"})
"""Methods vLLM applies while loading an unquantized (16- or 32-bit) checkpoint."""

_FAMILIES = (
    frozenset({"awq", "awq_marlin", "marlin"}),
    frozenset({"gptq", "gptq_marlin", "gptq_marlin_24", "marlin"}),
    frozenset({"modelopt", "modelopt_fp4"}),
)
_FP8_WEIGHTS = frozenset({"fp8", "fbgemm_fp8", "ptpc_fp8"})


def method_name(method: str) -> str:
    """A quantization method as vLLM compares them: lower case, ``-`` as ``_``."""
    return method.strip().lower().replace("-", "_")


def checkpoint_conflict(asked: str, checkpoint: str | None) -> str | None:
    """Why ``vllm_quantization`` ``asked`` contradicts the checkpoint's ``quant_method`` (None: unquantized), or
    None when vLLM takes it."""
    mine = method_name(asked)
    if checkpoint is None:
        if mine in ONLINE:
            return None
        return (f"expected null or {', '.join(sorted(ONLINE))} (the only method vLLM applies to an unquantized"
                f" checkpoint while loading it), found {asked}: the checkpoint's config.json has no"
                " quantization_config")
    theirs = method_name(checkpoint)
    if mine == theirs or any(mine in family and theirs in family for family in _FAMILIES):
        return None
    return (f"expected null or {theirs} (the checkpoint's config.json quantization_config.quant_method; vLLM refuses"
            f" another), found {asked}")


def capability(text: str | None) -> tuple[int, int] | None:
    """``"8.6"`` -> (8, 6); None when unknown or not of that form."""
    major, dot, minor = (text or "").partition(".")
    return (int(major), int(minor)) if dot and major.isdigit() and minor.isdigit() else None


def fp8_weights(method: str | None) -> bool:
    """Whether weights quantized by ``method`` are fp8."""
    return method is not None and method_name(method) in _FP8_WEIGHTS


def shown(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"
