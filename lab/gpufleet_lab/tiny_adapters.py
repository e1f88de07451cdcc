"""The lab's LoRA adapters for its tiny model: random weights in PEFT's layout, made by the lab itself.

Deterministic (a seed per adapter): the same call writes the same bytes, so the inventory pins each adapter by its
weights' SHA-256 as a site pins a fine-tune's. The B matrices are not zero (a trained adapter's are not either), so
an adapter's answer differs from the model's for the same prompt and seed. The lab's mirror writes them beside
the model, with their digests in ``sha256sums.txt``; the lab's inventory declares them from there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gpufleet_lab.tiny_model import TinyLlama, write_bf16_safetensors

NODE_MODEL = "/var/lib/gpufleet/models/tiny-llama"
"""The model on the nodes (inventories/lab/group_vars/lab.yml's vllm_model): what the adapters were made for."""
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
SUMS_FILE = "sha256sums.txt"
TARGETS = ("q_proj", "v_proj")


@dataclass(frozen=True)
class TinyAdapter:
    """One lab adapter: its name (what clients ask for), rank and seed."""

    name: str
    rank: int
    seed: int


LAB_ADAPTERS = (TinyAdapter("tiny-poet", 4, 101), TinyAdapter("tiny-coder", 8, 102), TinyAdapter("tiny-chef", 8, 103))
"""The adapters the lab's pools declare."""
LATER_ADAPTER = TinyAdapter("tiny-critic", 8, 104)
"""One more, made beside them and declared only by the test that adds an adapter to the running pools."""


LAB_ARCH = TinyLlama()
"""The tiny model's shape, the one the adapters' matrices fit."""


def make_tiny_adapter(out_dir: Path, adapter: TinyAdapter, arch: TinyLlama = LAB_ARCH, base: str = NODE_MODEL) -> Path:
    """Write ``adapter`` (``adapter_config.json`` and bf16 ``adapter_model.safetensors``) into ``out_dir``."""
    import numpy as np

    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(adapter.seed)
    shapes = arch.tensor_shapes()
    tensors = {}
    for layer in range(arch.layers):
        for module in TARGETS:
            out_features, in_features = shapes[f"model.layers.{layer}.self_attn.{module}.weight"]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0.0, 0.2, (adapter.rank, in_features))
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0.0, 0.2, (out_features, adapter.rank))
    write_bf16_safetensors(out_dir / WEIGHTS_FILE, tensors)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": adapter.rank,
              "lora_alpha": 2 * adapter.rank, "lora_dropout": 0.0, "target_modules": list(TARGETS), "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None, "inference_mode": True}
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    return out_dir


def make_lab_adapters(root: Path) -> dict[str, str]:
    """Every lab adapter (:data:`LAB_ADAPTERS` and :data:`LATER_ADAPTER`) in ``root/<name>/``, and
    ``root/sha256sums.txt``: each one's weights' SHA-256, by name (also returned)."""
    from gpufleet.digest import file_sha256

    sums = {}
    for adapter in (*LAB_ADAPTERS, LATER_ADAPTER):
        folder = make_tiny_adapter(root / adapter.name, adapter)
        sums[adapter.name] = file_sha256(folder / WEIGHTS_FILE)
    (root / SUMS_FILE).write_text("".join(f"{digest}  {name}/{WEIGHTS_FILE}\n" for name, digest in sums.items()))
    return sums


def declared(root: Path, adapters: tuple[TinyAdapter, ...] = LAB_ADAPTERS) -> dict[str, dict[str, str]]:
    """``vllm_lora_adapters`` for ``adapters`` as made in ``root``, each pinned by the digest in its
    ``sha256sums.txt``; empty before the mirror made them."""
    sums_file = root / SUMS_FILE
    if not sums_file.is_file():
        return {}
    sums = {line.split()[1].split("/")[0]: line.split()[0] for line in sums_file.read_text().splitlines() if line}
    return {a.name: {"source": str(root / a.name), "sha256": sums[a.name]} for a in adapters if a.name in sums}
