"""The planner: TP/PP rules, placement along NVLink islands, argv and env, errors with arithmetic."""

from __future__ import annotations

import json

import pytest
import yaml

from gpufleet.gpu.profiles import profile_facts
from gpufleet.gpu.report import NodeFacts
from gpufleet.plan.layout import gpu_sets, node_shape
from gpufleet.plan.planner import FleetPlan, PlanProblem
from tests.conftest import Project, run_cli
from tests.unit.project_plans import cli_plan, fleet_plan


def test_bridged_pairs_tp2_four_replicas_on_pairs(project: Project) -> None:
    rc, replicas, err = cli_plan(project, """
        vllm_model: meta-llama/Llama-3.1-8B-Instruct
        gpu_profile: 8xA100-PCIe-pairs
        vllm_tensor_parallel_size: 2
        vllm_max_model_len: 8192
    """, 'pcie = ["p1"]')
    assert rc == 0, err
    assert [r["gpus"]["p1"] for r in replicas] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [r["port"] for r in replicas] == [8000, 8001, 8002, 8003]
    assert [r["env"]["p1"]["CUDA_VISIBLE_DEVICES"] for r in replicas] == ["0,1", "2,3", "4,5", "6,7"]
    assert "without NVLink" not in err


def test_small_model_auto_one_gpu_per_replica_eight_per_node(project: Project) -> None:
    rc, replicas, err = cli_plan(project, """
        vllm_model: meta-llama/Llama-3.1-8B-Instruct
        gpu_profile: 8xH100-SXM
        vllm_max_model_len: 8192
    """, 'small = ["h1", "h2"]')
    assert rc == 0, err
    assert len(replicas) == 16 and {r["tp"] for r in replicas} == {1}
    r0 = replicas[0]
    # Llama-3.1-8B bf16: 2 x 32 layers x 8 KV heads x 128 x 2 B = 131,072 B per token.
    assert r0["kv_bytes_per_token"] == 131_072
    assert r0["weights_bytes_per_gpu"] == pytest.approx(16.06e9, rel=0.01)
    assert r0["max_concurrency"] >= 8
    argv = r0["argv"]["h1"]
    assert argv[:3] == ["/opt/vllm/0.33.0/bin/vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "1"
    assert argv[argv.index("--port") + 1] == "8000"
    assert replicas[7]["port"] == 8007 and replicas[7]["gpus"] == {"h1": [7]}


def test_70b_auto_picks_smallest_tp_on_the_island(project: Project) -> None:
    rc, replicas, err = cli_plan(project, """
        vllm_model: meta-llama/Llama-3.1-70B-Instruct
        gpu_profile: 8xH100-SXM
        vllm_max_model_len: 32768
    """, 'big = ["h1"]')
    assert rc == 0, err
    # TP 2: 65.7 GiB weights per GPU leave ~5 GiB of KV: < 8 sequences of 32k. TP 4 holds ~15.
    assert [r["tp"] for r in replicas] == [4, 4]
    assert [r["gpus"]["h1"] for r in replicas] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replicas[0]["kv_bytes_per_token"] == 81_920  # 2 x 80 x (8/4) x 128 x 2


def test_h100_tp8_one_island(project: Project) -> None:
    rc, replicas, err = cli_plan(project, """
        vllm_model: meta-llama/Llama-3.1-70B-Instruct
        gpu_profile: 8xH100-SXM
        vllm_tensor_parallel_size: 8
        vllm_max_model_len: 32768
    """, 'big = ["h1"]')
    assert rc == 0, err
    assert len(replicas) == 1 and replicas[0]["gpus"] == {"h1": [0, 1, 2, 3, 4, 5, 6, 7]}


def test_pp_across_nodes_only_when_one_node_cannot_hold(project: Project) -> None:
    rc, replicas, err = cli_plan(project, """
        vllm_model: deepseek-ai/DeepSeek-V3
        gpu_profile: 8xH100-SXM
        fleet_interface: eth1
        vllm_max_model_len: 32768
    """, 'ds = [("d1", {"fleet_address": "10.9.0.1"}), ("d2", {"fleet_address": "10.9.0.2"}), "d3"]')
    assert rc == 0, err
    assert len(replicas) == 1
    r = replicas[0]
    assert (r["tp"], r["pp"], r["nodes"]) == (8, 2, ["d1", "d2"])
    assert r["roles"] == {"d1": "mp-rank-0", "d2": "mp-rank-1"}
    assert "d3 left idle" in err
    head, worker = r["argv"]["d1"], r["argv"]["d2"]
    for argv, rank in ((head, "0"), (worker, "1")):
        assert argv[argv.index("--nnodes") + 1] == "2"
        assert argv[argv.index("--node-rank") + 1] == rank
        assert argv[argv.index("--master-addr") + 1] == "10.9.0.1"
    assert "--headless" in worker and "--headless" not in head
    assert r["env"]["d2"] == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "VLLM_HOST_IP": "10.9.0.2",
                              "NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1"}
    # MLA: (512 + 64) x 2 B per layer, not split by TP. The stages hold 31 and 30 layers; the last one, with the
    # output head and the sampler's peak, sizes the cache.
    assert r["kv_bytes_per_token"] == 1152 * 30
    assert r["budget"][0].startswith("stage 2 of 2: 79.2 GiB x 0.92 = 72.8 GiB usable;")


RAY_HOSTS = 'ds = [("d1", {"fleet_address": "10.9.0.1"}), ("d2", {"fleet_address": "10.9.0.2"})]'
RAY_POOL = """
    vllm_model: deepseek-ai/DeepSeek-V3
    gpu_profile: 8xH100-SXM
    fleet_interface: ib0
    vllm_nodes_per_replica: 2
    vllm_distributed_backend: ray
    ray_auth_token: {env: RAY_AUTH_TOKEN}
    vllm_max_model_len: 32768
"""


def test_ray_backend_head_and_worker_processes(project: Project) -> None:
    rc, replicas, err = cli_plan(project, RAY_POOL, RAY_HOSTS)
    assert rc == 0, err
    procs = replicas[0]["processes"]
    assert [p["unit"] for p in procs["d1"]] == ["ray-head", "vllm"]
    assert [p["unit"] for p in procs["d2"]] == ["ray-worker"]
    head_ray = procs["d1"][0]["argv"]
    assert "--head" in head_ray and "--node-ip-address=10.9.0.1" in head_ray and "--include-dashboard=false" in head_ray
    assert "--address=10.9.0.1:6379" in procs["d2"][0]["argv"]
    vllm = procs["d1"][1]["argv"]
    assert vllm[vllm.index("--distributed-executor-backend") + 1] == "ray" and "--nnodes" not in vllm
    assert procs["d2"][0]["env"]["GLOO_SOCKET_IFNAME"] == "ib0"


TP16_HOSTS = 'ds = [("d1", {"fleet_address": "10.9.0.1"}), ("d2", {"fleet_address": "10.9.0.2"})]'
TP16_POOL = (
    "vllm_model: deepseek-ai/DeepSeek-V3\ngpu_profile: 8xH100-SXM\nfleet_interface: ib0\n"
    "vllm_tensor_parallel_size: 16\nvllm_max_model_len: 32768\n"
)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_tp_across_nodes_is_one_tp_group_over_both_nodes(project: Project, backend: str) -> None:
    extra = "vllm_distributed_backend: ray\nray_auth_token: {env: RAY_AUTH_TOKEN}\n" if backend == "ray" else ""
    rc, replicas, err = cli_plan(project, TP16_POOL + extra, TP16_HOSTS)
    assert rc == 0, err
    (r,) = replicas
    assert (r["tp"], r["pp"], r["nodes"], r["backend"]) == (16, 1, ["d1", "d2"], backend)
    assert r["gpus"] == {"d1": list(range(8)), "d2": list(range(8))}
    assert "TP 16 spans 2 nodes of 8 GPUs: every layer's all-reduce crosses the network between them (ib0)" in err
    assert r["kv_bytes_per_token"] == 61 * 1152  # one stage: every layer's latent on every GPU
    vllm = [(host, p["argv"]) for host, procs in r["processes"].items() for p in procs if p["unit"] == "vllm"]
    for _, argv in vllm:
        assert (_flag(argv, "--tensor-parallel-size"), _flag(argv, "--pipeline-parallel-size")) == ("16", "1")
    if backend == "mp":
        assert [host for host, _ in vllm] == ["d1", "d2"]
        for (_, argv), rank in zip(vllm, ("0", "1"), strict=True):
            assert (_flag(argv, "--nnodes"), _flag(argv, "--node-rank")) == ("2", rank)
            assert _flag(argv, "--master-addr") == "10.9.0.1" and ("--headless" in argv) == (rank == "1")
    else:  # vLLM on the head only, over the Ray cluster of both nodes; --nnodes stays 1 with Ray
        assert [host for host, _ in vllm] == ["d1"] and "--nnodes" not in vllm[0][1]
        assert _flag(vllm[0][1], "--distributed-executor-backend") == "ray"
        assert [p["unit"] for p in r["processes"]["d2"]] == ["ray-worker"]


def test_tp_across_nodes_times_pp(project: Project) -> None:
    hosts = 'ds = ' + str([(f"d{i}", {"fleet_address": f"10.9.0.{i}"}) for i in range(1, 6)])
    rc, replicas, err = cli_plan(project, TP16_POOL + "vllm_pipeline_parallel_size: 2\n", hosts)
    assert rc == 0, err
    (r,) = replicas
    assert (r["tp"], r["pp"], r["nodes"]) == (16, 2, ["d1", "d2", "d3", "d4"])
    assert [_flag(r["argv"][h], "--node-rank") for h in r["nodes"]] == ["0", "1", "2", "3"]
    assert "d5 left idle: a replica needs 4 nodes" in err


@pytest.mark.parametrize(("extra", "hosts", "expected"), [
    ("vllm_nodes_per_replica: 3\n", TP16_HOSTS,
     "vllm_nodes_per_replica: 3 does not fit TP 16 x PP 1 on nodes of 8 GPUs: 2 nodes of 8 GPUs per stage, 2 in all"),
    ("", 'ds = [("d1", {"fleet_address": "10.9.0.1"})]', "TP 16 x PP 1 on nodes of 8 GPUs needs 2 nodes of 8 GPUs;"
     " pool ds has 1"),
    ("vllm_gpu_memory_utilization: 0.5\n", TP16_HOSTS,
     "does not fit at TP 16 x PP 1 on 2 node(s) of 8 x NVIDIA H100 80GB HBM3"),
])
def test_tp_across_nodes_refusals(project: Project, extra: str, hosts: str, expected: str) -> None:
    rc, _, err = cli_plan(project, TP16_POOL + extra, hosts)
    assert rc == 2 and "Traceback" not in err
    assert expected in err, err


def test_ipv6_fleet_addresses_are_bracketed_where_a_port_follows(project: Project) -> None:
    rc, replicas, err = cli_plan(project, RAY_POOL, RAY_HOSTS.replace("10.9.0.", "fd00:9::"))
    assert rc == 0, err
    procs = replicas[0]["processes"]
    assert "--node-ip-address=fd00:9::1" in procs["d1"][0]["argv"]  # an address alone stays bare
    assert "--address=[fd00:9::1]:6379" in procs["d2"][0]["argv"]
    assert procs["d2"][0]["env"]["RAY_ADDRESS"] == "[fd00:9::1]:6379"
    vllm = procs["d1"][1]["argv"]
    assert vllm[vllm.index("--host") + 1] == "fd00:9::1"


@pytest.mark.parametrize(
    ("all_yml", "inventory", "expected"),
    [
        ("vllm_model: meta-llama/Llama-3.1-70B-Instruct\ngpu_profile: 8xH100-SXM\nvllm_tensor_parallel_size: 3\n",
         'a = ["h1"]',
         "vllm_tensor_parallel_size: 3 does not divide Llama-3.1-70B's 64 attention heads (64 / 3 = 21.3333)"),
        ("vllm_model: meta-llama/Llama-3.1-70B-Instruct\ngpu_profile: 8xH100-SXM\nvllm_tensor_parallel_size: 8\n"
         "vllm_pipeline_parallel_size: 2\nvllm_max_model_len: 8192\n",
         'a = ["h1"]', "TP 8 x PP 2 x DP 1 = 16 GPUs > 8 GPUs on h1"),
        ("vllm_model: meta-llama/Llama-3.1-405B-Instruct\ngpu_profile: 8xH100-SXM\nvllm_max_model_len: 8192\n",
         'a = ["h1"]', "weights and reserve do not fit"),
        ("vllm_model: meta-llama/Llama-3.1-70B-Instruct\ngpu_profile: 8xL40S-PCIe\nvllm_tensor_parallel_size: 4\n",
         'a = ["h1"]', "the KV pool cannot hold one sequence of 131,072 tokens (max_model_len)"),
        ("vllm_model: meta-llama/Llama-3.1-8B-Instruct\ngpu_profile: 8xH100-SXM\nvllm_max_model_len: 200000\n",
         'a = ["h1"]', "vllm_max_model_len: 200,000 is beyond Llama-3.1-8B's limit of 131,072 tokens"),
        ("vllm_model: deepseek-ai/DeepSeek-V3\nfleet_interface: eth0\nvllm_nodes_per_replica: 2\n"
         "vllm_max_model_len: 8192\n",
         'a = [("h1", {"gpu_profile": "8xH100-SXM"}), ("h2", {"gpu_profile": "8xH200-SXM"})]',
         "different GPU models in one replica: h1: NVIDIA H100 80GB HBM3; h2: NVIDIA H200"),
        ("vllm_model: meta-llama/Llama-3.1-8B-Instruct\ngpu_profile: 8xH100-SXM\nvllm_max_model_len: 8192\n"
         "vllm_extra_args: {swap-space: 4}\n",
         'a = ["h1"]', "vllm_extra_args.swap-space: vLLM 0.33.0: removed from vLLM"),
        ("vllm_model: meta-llama/Llama-3.1-8B-Instruct\ngpu_profile: 8xB300-SXM\n",
         'a = ["h1"]', "gpu_profile: unknown GPU 'B300'"),
        ("vllm_model: acme/secret-model\ngpu_profile: 8xH100-SXM\n",
         'a = ["h1"]', "vllm_model: cannot read the model's config.json"),
    ],
)
def test_plan_errors_show_the_arithmetic(project: Project, all_yml: str, inventory: str, expected: str) -> None:
    rc, _, err = cli_plan(project, all_yml, inventory)
    assert rc == 2
    assert expected in err, err
    assert "Traceback" not in err


def test_tp_over_pcie_is_a_warning(project: Project) -> None:
    rc, replicas, err = cli_plan(project, """
        vllm_model: meta-llama/Llama-3.1-70B-Instruct
        gpu_profile: 8xL40S-PCIe
        vllm_max_model_len: 8192
    """, 'a = ["h1"]')
    assert rc == 0, err
    assert "spans GPUs without NVLink" in err
    assert replicas[0]["tp"] == 4 and replicas[0]["gpus"]["h1"] == [0, 1, 2, 3]  # one NUMA node


def test_secrets_never_in_argv_or_env(project: Project) -> None:
    rc, replicas, err = cli_plan(project, """
        vllm_model: meta-llama/Llama-3.1-8B-Instruct
        gpu_profile: 1xH100-SXM
        vllm_max_model_len: 8192
        vllm_api_key: {env: GPUFLEET_TEST_KEY}
    """, 'a = ["h1"]')
    assert rc == 0, err
    text = json.dumps(replicas)
    assert "GPUFLEET_TEST_KEY" not in text and "--api-key" not in text
    assert replicas[0]["secret_env"] == ["VLLM_API_KEY"]


def test_facts_dir_is_used_instead_of_profiles(project: Project) -> None:
    facts = project.root / "facts"
    facts.mkdir()
    (facts / "h1.json").write_text(profile_facts("4xA100-PCIe-pairs", "h1").to_json())
    rc, replicas, err = cli_plan(project, """
        vllm_model: meta-llama/Llama-3.1-8B-Instruct
        vllm_tensor_parallel_size: 2
        vllm_max_model_len: 8192
    """, 'a = ["h1"]', "--facts", str(facts))
    assert rc == 0, err
    assert [r["gpus"]["h1"] for r in replicas] == [[0, 1], [2, 3]]
    (facts / "h1.json").write_text("{not json")
    rc, _, err = cli_plan(project, "vllm_model: meta-llama/Llama-3.1-8B-Instruct\n", 'a = ["h1"]', "--facts",
                          str(facts))
    assert rc == 2 and "h1.json:1:2: invalid JSON" in err


def test_gpu_sets_follow_islands() -> None:
    pairs = node_shape("p", profile_facts("8xA100-PCIe-pairs", "p"))
    assert gpu_sets(pairs, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert gpu_sets(pairs, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # by NUMA node when islands are too small
    h100: NodeFacts = profile_facts("8xH100-SXM", "h")
    assert gpu_sets(node_shape("h", h100), 8) == [list(range(8))]


def test_example_inventory_plans_offline() -> None:
    result = run_cli("plan", "inventories/prod.py", "--json")
    assert result.rc == 0, result.err
    replicas = json.loads(result.out)
    llama = [r for r in replicas if r["pool"] == "llama_70b"]
    deepseek = [r for r in replicas if r["pool"] == "deepseek_v3"]
    assert len(llama) == 8 and {r["tp"] for r in llama} == {4}
    assert len(deepseek) == 1 and (deepseek[0]["tp"], deepseek[0]["pp"]) == (8, 2)
    for r in replicas:
        for key in ("name", "nodes", "tp", "pp", "dp", "gpus", "kv_bytes_per_token", "weights_bytes_per_gpu",
                    "kv_pool_bytes_per_gpu", "max_concurrency", "argv", "env"):
            assert key in r
    table = run_cli("plan", "inventories/prod.py")
    assert table.rc == 0 and "deepseek_v3-0" in table.out and "ray-head" in table.out


def test_model_info_json() -> None:
    result = run_cli("model-info", "Llama-3-70B", "--json")
    assert result.rc == 0, result.err
    info = json.loads(result.out)
    assert (info["num_layers"], info["num_kv_heads"], info["head_dim"]) == (80, 8, 128)
    assert info["kv_bytes_per_token"] == 327_680
    assert abs(info["param_count"] - 70.6e9) / 70.6e9 < 0.03
    fp8 = json.loads(run_cli("model-info", "Llama-3-70B", "--kv-dtype", "fp8", "--tp", "8", "--json").out)
    assert fp8["kv_bytes_per_token"] == 327_680 // 2 // 8
    ds = json.loads(run_cli("model-info", "DeepSeek-V3", "--json").out)
    assert ds["kv_bytes_per_token"] == 1152 * 61
    bad = run_cli("model-info", "/nonexistent/config.json", "--json")
    assert bad.rc == 2 and "Traceback" not in bad.err and "no such file" in bad.err
    for tp in ("٨", "0", "8.0", "2048"):  # numbers are read one way: ASCII digits, in range
        refused = run_cli("model-info", "Llama-3-70B", "--tp", tp)
        assert refused.rc == 2 and f"expected a whole number from 1 to 1024, found {tp!r}" in refused.err, refused.err


def test_plan_problems_are_objects_printed_as_lines(project: Project) -> None:
    """Without declared profiles the plan itself refuses (check cannot): each problem one line, by pool."""
    facts = project.root / "facts"
    facts.mkdir()
    (facts / "h1.json").write_text(profile_facts("8xH100-SXM", "h1").to_json())
    rc, _, err = cli_plan(project, """
        vllm_model: meta-llama/Llama-3.1-70B-Instruct
        vllm_tensor_parallel_size: 3
    """, 'a = ["h1"]', "--facts", str(facts))
    assert rc == 2
    assert err.splitlines() == [
        "pool a: vllm_tensor_parallel_size 3 does not divide Llama-3.1-70B's 64 attention heads (64 / 3 = 21.3333)"
        " with 8 KV heads; valid: 1, 2, 4, 8, 16, 32, 64"]


def test_plan_problem_says_where_and_whom_it_stops() -> None:
    pool = PlanProblem("big", "vllm_nodes_per_replica 3 > 2 hosts in pool big", keys=("vllm_nodes_per_replica",),
                       detail="3 > 2 hosts in pool big")
    flag = PlanProblem("big", "vLLM 0.33.0: --x: unknown", "h2", "big-0", ("vllm_extra_args",))
    assert pool.line() == "pool big: vllm_nodes_per_replica 3 > 2 hosts in pool big"
    assert flag.line() == "big-0 on h2: vLLM 0.33.0: --x: unknown"
    assert pool.said_of("vllm_nodes_per_replica") == "3 > 2 hosts in pool big"
    assert pool.said_of("vllm_model") == pool.text
    plan = FleetPlan(problems=[pool, flag])
    assert plan.problems_of("h1", "big") == [pool] and plan.problems_of("h2", "big") == [pool, flag]
    assert plan.problems_of("h3", "small") == []


def test_an_unknown_quantization_is_a_problem_of_its_pool_only(project: Project) -> None:
    plan = fleet_plan(project, "vllm_max_model_len: 8192\n", """
        good = [("h1", {"vllm_model": "meta-llama/Llama-3.1-8B-Instruct"})]
        odd = [("h2", {"vllm_model": "meta-llama/Llama-3.1-8B-Instruct", "vllm_quantization": "notamethod"})]
    """)
    assert {r.pool for r in plan.replicas} == {"good"}
    (problem,) = plan.problems
    assert (problem.pool, problem.host, problem.keys) == ("odd", None, ("vllm_quantization",))
    assert problem.line().startswith("pool odd: unknown quantization 'notamethod'; accepted: ")


def test_planned_config_yaml_is_typed_from_the_config(project: Project) -> None:
    """Numbers stay numbers, a name that looks like a number stays text, false, lists and mappings as argv has
    them; the model is the unit's VLLM_MODEL, not a flag."""
    plan = fleet_plan(project, """
        vllm_model: meta-llama/Llama-3.1-8B-Instruct
        vllm_served_model_name: "8"
        vllm_max_model_len: 8192
        vllm_tensor_parallel_size: 8
        vllm_extra_args:
          enable-prefix-caching: false
          max-num-seqs: 64
          logits-processors: [a.B, c.D]
          override-generation-config: {temperature: 0.5}
    """, 'a = ["h1"]')
    assert plan.problems == []
    (process,) = plan.replicas[0].roles[0].processes
    config = yaml.safe_load(process.config_yaml())
    assert config == {
        "served-model-name": "8", "host": "h1", "port": 8000, "tensor-parallel-size": 8,
        "pipeline-parallel-size": 1, "max-model-len": 8192, "gpu-memory-utilization": 0.92, "shutdown-timeout": 60,
        "max-num-queued-reqs": 128,  # twice max-num-seqs: the KV cache holds more at 8192 tokens
        "enable-prefix-caching": False, "max-num-seqs": 64, "logits-processors": ["a.B", "c.D"],
        "override-generation-config": '{"temperature":0.5}'}
    assert process.argv[3:] == [
        "--served-model-name", "8", "--host", "h1", "--port", "8000", "--tensor-parallel-size", "8",
        "--pipeline-parallel-size", "1", "--max-model-len", "8192", "--gpu-memory-utilization", "0.92",
        "--shutdown-timeout", "60", "--max-num-queued-reqs", "128", "--no-enable-prefix-caching",
        "--max-num-seqs", "64",
        "--logits-processors", "a.B", "--logits-processors", "c.D",
        "--override-generation-config", '{"temperature":0.5}']


def test_the_printed_plan_keeps_bracketed_addresses(project: Project) -> None:
    project.group_vars("all", RAY_POOL)
    project.inventory(RAY_HOSTS.replace("10.9.0.", "fd00:9::"))
    result = run_cli("plan", "inventories/fleet.py", cwd=project.root)
    assert result.rc == 0, result.err
    assert "RAY_ADDRESS=[fd00:9::1]:6379" in result.out and "--address=[fd00:9::1]:6379" in result.out
