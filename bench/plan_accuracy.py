"""How close the planner's memory figures come to what vLLM itself reported at start-up.

    python bench/plan_accuracy.py [REFERENCE.yml]     # default: tests/data/plan_accuracy/reference.yml

Every reference case (model, vLLM version, GPU, layout, flags, and vLLM's own figures) is planned with the
planner's memory model, as `gpufleet plan` plans a pool: the GPU's NVML memory converted to what the framework
sees, per-stage weights, the modelled reserve, the stage that sizes the KV cache. Prints JSON: per case the
planned and reported weights per GPU (the first stage's, which vLLM's rank 0 logs), KV tokens and reserve
where reported, their ratios (planned / vLLM) and whether each lies within the file's bounds; then per figure
the min, median and max ratio, and ``all_within``. Exits 0 when every ratio is within its bounds, else 3.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

from gpufleet.gpu.profiles import GPU_MODELS, framework_memory_bytes
from gpufleet.plan import layout
from gpufleet.plan.model_arch import load_arch
from gpufleet.plan.model_memory import GIB, stage_weights_per_gpu, weight_bytes

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "tests" / "data" / "plan_accuracy" / "reference.yml"


def load_cases(path: Path = REFERENCE) -> tuple[dict[str, list[float]], list[dict[str, Any]]]:
    """The file's bounds, and its cases with the defaults filled in and model paths resolved."""
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    cases = []
    for case in doc["cases"]:
        merged = {**doc["defaults"], **case}
        if merged["model"].endswith(".json"):
            merged["model"] = str(path.parent / merged["model"])
        cases.append(merged)
    return doc["bounds"], cases


def planned(case: dict[str, Any]) -> dict[str, float]:
    """The planner's figures for one case: first-stage weights per GPU, the replica's KV tokens, and the reserve
    (GiB) of the stage that sizes the cache."""
    arch = load_arch(case["model"])
    gpu = GPU_MODELS[case["gpu"]]
    memory = framework_memory_bytes(gpu.nvml_name, gpu.memory_bytes)
    total = weight_bytes(arch, case["dtype"], case["quantization"])
    s = layout.sizing(arch, total, dtype=case["dtype"], kv_dtype=case["kv_cache_dtype"],
                      utilization=case["gpu_memory_utilization"], max_model_len=case["max_model_len"],
                      version=case["vllm_version"], flags=case["flags"], gpu_name=gpu.nvml_name)
    tp, pp = case["tp"], case["pp"]
    budget, _ = layout.budget(s, memory, tp, pp)
    return {
        "weights_gib": round(stage_weights_per_gpu(arch, total, tp, pp, s.model_dtype)[0] / GIB, 4),
        "kv_tokens": budget.kv_tokens,
        "reserve_gib": round(budget.reserve_bytes / GIB, 4),
    }


def measure(path: Path = REFERENCE) -> dict[str, Any]:
    """Every case's planned and reported figures with their ratios, and a summary per figure."""
    bounds, cases = load_cases(path)
    keys = {"weights_gib": "weights", "kv_tokens": "kv_tokens", "reserve_gib": "reserve"}
    rows, ratios = [], {name: [] for name in keys.values()}
    for case in cases:
        plan = planned(case)
        reported = case["vllm"]
        row: dict[str, Any] = {"name": case["name"], "vllm_version": case["vllm_version"], "tp": case["tp"],
                               "pp": case["pp"], "planned": {}, "vllm": reported, "ratio": {}, "within": {}}
        for key, name in keys.items():
            if key not in reported:
                continue
            ratio = plan[key] / reported[key]
            low, high = bounds[name]
            row["planned"][key] = plan[key]
            row["ratio"][name] = round(ratio, 4)
            row["within"][name] = low <= ratio <= high
            ratios[name].append(ratio)
        rows.append(row)
    summary = {name: {"min": round(min(v), 4), "median": round(statistics.median(v), 4), "max": round(max(v), 4),
                      "cases": len(v), "bounds": bounds[name]}
               for name, v in ratios.items() if v}
    return {"cases": rows, "summary": summary,
            "all_within": all(ok for row in rows for ok in row["within"].values())}


def main() -> int:
    result = measure(Path(sys.argv[1]) if len(sys.argv) > 1 else REFERENCE)
    print(json.dumps(result, indent=2))
    return 0 if result["all_within"] else 3


if __name__ == "__main__":
    sys.exit(main())
