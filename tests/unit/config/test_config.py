"""Fleet configuration: precedence of the layers and one clear line per bad value (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, Project, run_cli

BASE = """\
vllm_model: meta-llama/Llama-3.1-8B-Instruct
gpu_profile: 8xH100-SXM
vllm_max_model_len: 8192
"""


def _two_groups(project: Project) -> Path:
    project.group_vars("all", BASE + "vllm_port: 8200\nvllm_gpu_memory_utilization: 0.8\nvllm_master_port: 29600\n")
    project.group_vars("small", "vllm_gpu_memory_utilization: 0.85\nvllm_master_port: 29700\n")
    project.group_vars("special", "vllm_master_port: 29800\n")
    return project.inventory("""
        small = [("n1", {"vllm_port": 8100}), "n2"]
        special = ["n2"]
    """)


def test_precedence_host_over_group_over_all_over_defaults(project: Project) -> None:
    from gpufleet.inventory.load import load_fleet

    fleet = load_fleet(str(_two_groups(project)))
    n1, n2 = fleet.configs["n1"], fleet.configs["n2"]
    assert n1.vllm_port == 8100 and n2.vllm_port == 8200  # host data > all.yml
    assert n1.vllm_gpu_memory_utilization == 0.85  # group > all
    assert n1.vllm_master_port == 29700 and n2.vllm_master_port == 29800  # the later group wins
    assert n1.vllm_kv_cache_dtype == "auto" and n1.ray_port == 6379  # role defaults
    assert fleet.pools == {"small": ["n1"], "special": ["n2"]}  # a host serves in the last group listing it


def test_pyinfra_data_overrides_everything(project: Project) -> None:
    inventory = _two_groups(project)
    deploy = project.root / "show.py"
    deploy.write_text(
        "from pyinfra import host, state\n"
        "from gpufleet.inventory.load import fleet_from_state\n"
        "cfg = fleet_from_state(state).configs[host.name]\n"
        "print(f'PORT {host.name} {cfg.vllm_port} UTIL {cfg.vllm_gpu_memory_utilization}')\n"
    )
    # The host is reached through pyinfra's local connector: no network, the deploy adds no operation.
    inventory = project.inventory('small = [("@local", {"vllm_port": 8100})]')
    (project.root / "group_vars" / "special.yml").unlink()  # no group special now: its file would be refused
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    pyinfra = str(Path(sys.executable).parent / "pyinfra")
    plain = subprocess.run([pyinfra, "-y", str(inventory), str(deploy)], capture_output=True, text=True,
                           cwd=project.root, env=env, timeout=120)
    assert "PORT @local 8100 UTIL 0.85" in plain.stdout + plain.stderr, plain.stderr
    over = subprocess.run([pyinfra, "-y", "--data", "vllm_port=8500", str(inventory), str(deploy)],
                          capture_output=True, text=True, cwd=project.root, env=env, timeout=120)
    assert "PORT @local 8500 UTIL 0.85" in over.stdout + over.stderr, over.stderr


@pytest.mark.parametrize(
    ("all_yml", "expected"),
    [
        ("vllm_model: [unclosed\n", "group_vars/all.yml:2:1: YAML syntax error: expected ',' or ']'"),
        (BASE + "vllm_max_modl_len: 4096\n",
         "group_vars/all.yml: vllm_max_modl_len: expected a known variable, found an unknown key;"
         " did you mean vllm_max_model_len?"),
        (BASE + "vllm_port: eighty\n", "group_vars/all.yml: vllm_port: expected an integer, found 'eighty'"),
        (BASE + "vllm_gpu_memory_utilization: 1.5\n",
         "group_vars/all.yml: vllm_gpu_memory_utilization: expected a number <= 1, found 1.5"),
        (BASE + "vllm_tensor_parallel_size: lots\n",
         "group_vars/all.yml: vllm_tensor_parallel_size: expected an integer from 1 to 1024 or auto, found 'lots'"),
        (BASE + "vllm_distributed_backend: mpi\n",
         "group_vars/all.yml: vllm_distributed_backend: expected one of mp, ray, found 'mpi'"),
        (BASE + "vllm_version: 0.6.3\n",
         "group_vars/all.yml: vllm_version: expected one of 0.33.0, 0.32.0, 0.31.0, found '0.6.3'"),
        (BASE + "vllm_api_key: sk-live-1234\n",
         "group_vars/all.yml: vllm_api_key: expected a reference {env: NAME} or {file: PATH}, found a literal string"),
        (BASE + "vllm_api_key: {env: A, file: /b}\n",
         "group_vars/all.yml: vllm_api_key: expected exactly one of env or file"),
        (BASE + "dcgm_exporter_port: 9100\n",
         "group_vars/all.yml: dcgm_exporter_port: expected a port of its own, found 9100 for both dcgm_exporter_port"
         " and node_exporter_port"),
        (BASE + "vllm_nodes_per_replica: 2\n",
         "roles/fleet/defaults.yml: fleet_interface: expected an interface name for multi-node replicas"),
        ("gpu_profile: 8xH100-SXM\n", "inventories/fleet.py: vllm_model: expected a value, found nothing (required)"),
        ("- just\n- a list\n", "group_vars/all.yml: expected a mapping of variables, found a list"),
    ],
)
def test_bad_input_one_line_exit_2_no_traceback(project: Project, all_yml: str, expected: str) -> None:
    project.group_vars("all", all_yml)
    project.inventory('servers = ["gpu-1.invalid", "gpu-2.invalid"]')
    result = run_cli("check", "inventories/fleet.py", cwd=project.root)
    assert result.rc == 2, result
    assert "Traceback" not in result.err
    lines = result.err.strip().splitlines()
    assert any(line.startswith(expected) or expected in line for line in lines), lines
    # Identical problems of several hosts fold into one line.
    assert len(lines) == len(set(lines)) and len(lines) <= 2


def test_several_problems_one_line_each(project: Project) -> None:
    project.group_vars("all", BASE + "vllm_port: 0\nvllm_dtype: fp4\nray_dashbord: true\n")
    project.inventory('servers = [("gpu-1.invalid", {"vllm_min_concurrency": -1})]')
    result = run_cli("check", "inventories/fleet.py", cwd=project.root)
    assert result.rc == 2
    lines = sorted(result.err.strip().splitlines())
    assert lines == sorted([
        "group_vars/all.yml: ray_dashbord: expected a known variable, found an unknown key; did you mean ray_dashboard?"
        " (host gpu-1.invalid)",
        "group_vars/all.yml: vllm_port: expected a number >= 1, found 0 (host gpu-1.invalid)",
        "group_vars/all.yml: vllm_dtype: expected one of auto, bfloat16, float16, float32, found 'fp4'"
        " (host gpu-1.invalid)",
        "inventories/fleet.py: vllm_min_concurrency: expected a number >= 1, found -1 (host gpu-1.invalid)",
    ])


def test_bad_input_stops_pyinfra_before_any_host(project: Project) -> None:
    """The same check runs when pyinfra reads the inventory: exit 2, no connection attempted."""
    project.group_vars("all", BASE + "vllm_port: eighty\n")
    inventory = project.inventory('servers = ["gpu-1.invalid"]')
    deploy = project.root / "noop.py"
    deploy.write_text("")
    pyinfra = str(Path(sys.executable).parent / "pyinfra")
    proc = subprocess.run([pyinfra, "-y", str(inventory), str(deploy)], capture_output=True, text=True,
                          cwd=project.root, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 2
    assert "group_vars/all.yml: vllm_port: expected an integer, found 'eighty'" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "Connecting" not in proc.stdout + proc.stderr and "gpu-1.invalid" not in proc.stdout


def test_example_inventory_is_valid() -> None:
    result = run_cli("check", "inventories/prod.py")
    assert result.rc == 0, result.err
    assert "6 hosts in 2 pools" in result.out


def test_missing_inventory_file() -> None:
    result = run_cli("check", "inventories/nope.py")
    assert result.rc == 2
    assert result.err.strip() == "inventories/nope.py: expected an inventory file, found no such file"


def test_gpu_health_thresholds_are_typed(project: Project) -> None:
    from gpufleet.inventory.load import load_fleet

    project.group_vars("all", BASE + "gpu_health: {expected_gpu_count: 8, min_driver_branch: 570}\n")
    fleet = load_fleet(str(project.inventory('a = ["h1"]')))
    policy = fleet.configs["h1"].gpu_health
    assert (policy.expected_gpu_count, policy.min_driver_branch, policy.require_persistence_mode) == (8, 570, True)
    project.group_vars("all", BASE + "gpu_health: {expected_gpu_cnt: 4}\n")
    result = run_cli("check", "inventories/fleet.py", cwd=project.root)
    assert result.rc == 2
    assert "group_vars/all.yml: gpu_health.expected_gpu_cnt: expected one of expected_gpu_count" in result.err


def test_check_refuses_what_plan_refuses(project: Project) -> None:
    """One validation path: the plan's rules run in `check` (and when pyinfra reads the inventory)."""
    project.group_vars("all", BASE + "vllm_tensor_parallel_size: 3\n")
    project.inventory('servers = ["gpu-1.invalid"]')
    check = run_cli("check", "inventories/fleet.py", cwd=project.root)
    plan = run_cli("plan", "inventories/fleet.py", cwd=project.root)
    assert check.rc == plan.rc == 2
    assert check.err.splitlines()[0] == plan.err.splitlines()[0]
    assert check.err.startswith("group_vars/all.yml: vllm_tensor_parallel_size: 3 does not divide Llama-3.1-8B's 32")


def test_example_inventory_plans() -> None:
    assert run_cli("plan", "inventories/prod.py", "--json").rc == 0


@pytest.mark.parametrize("count", [None, 1, 8, 0, -1, True, "8", 8.0])
def test_health_policy_has_one_schema(project: Project, count: object) -> None:
    """What config validation accepts for gpu_health, the node's gate accepts, and the other way round."""
    from gpufleet.config.layers import HostLayers, Layer, role_default_layers
    from gpufleet.config.validate import validate_host
    from gpufleet.node.health_rules import PolicyError, policy_from_dict

    try:
        policy_from_dict({"expected_gpu_count": count})
        gate_ok = True
    except PolicyError:
        gate_ok = False
    defaults, _ = role_default_layers()
    layers = HostLayers("h", [*defaults, Layer("all.yml", {"vllm_model": "meta-llama/Llama-3.1-8B-Instruct",
                                                           "gpu_health": {"expected_gpu_count": count}})])
    config, problems = validate_host(layers, "inventory")
    assert (config is not None) == gate_ok == (count is None or (type(count) is int and count >= 1)), problems


@pytest.mark.parametrize(("text", "expected"), [
    (b"a: 1\na: 2\n", ":2", ),
    (b"a: \xff\n", "byte 0xff at byte offset 3"),
    (b"a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
     b"c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
     b"e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n", "alias"),
])
def test_strict_yaml(text: bytes, expected: str) -> None:
    from gpufleet.config.yaml_strict import YamlProblem, load_yaml

    with pytest.raises(YamlProblem) as caught:
        load_yaml(text)
    assert expected in caught.value.where + caught.value.message


def test_small_aliases_still_load() -> None:
    from gpufleet.config.yaml_strict import load_yaml

    assert load_yaml(b"base: &b {x: 1}\nother: {<<: *b, y: 2}\n") == {"base": {"x": 1}, "other": {"x": 1, "y": 2}}


SECRET = "sk-live-s3cr3t-value"


@pytest.mark.parametrize("edit", [
    f"vllm_api_key: {SECRET}\n", f"vllm_api_key: [{SECRET}]\n", f"vllm_hf_token: {{env: {SECRET}}}\n",
    f"ray_auth_token: {{path: {SECRET}}}\n", f"vllm_extra_args: {{api-key: {SECRET}}}\n",
    f"vllm_env: {{OPENAI_API_KEY: {SECRET}}}\n", f"vllm_env: {{HF_TOKEN: {SECRET}}}\n",
])
def test_secret_values_are_never_shown(project: Project, edit: str) -> None:
    project.group_vars("all", BASE + edit)
    project.inventory('servers = ["gpu-1.invalid"]')
    result = run_cli("check", "inventories/fleet.py", cwd=project.root)
    assert result.rc == 2 and SECRET not in result.err + result.out, result.err


def test_data_arguments_read_as_pyinfra_reads_them() -> None:
    from gpufleet.inventory.load import cli_data_override

    argv = ["-y", "--data", "vllm_port=8001", "--data=vllm_start=FALSE", "--data", 'vllm_env={"A": "1"}',
            "inv.py", "deploy.py"]
    assert cli_data_override(argv) == {"vllm_port": 8001, "vllm_start": False, "vllm_env": {"A": "1"}}
    samples = ["true", "False", "8000", "-3", "8000.5", "[1, 2]", '{"a": 1}', "null", "main; touch /tmp/x", "", "0x10"]
    # pyinfra's own parser, in a child process (importing pyinfra's CLI monkey-patches the process with gevent)
    code = ("import json, sys; from pyinfra_cli.util import parse_cli_arg;"
            "print(json.dumps([parse_cli_arg(a) for a in json.loads(sys.argv[1])]))")
    theirs = subprocess.run([sys.executable, "-c", code, json.dumps(samples)], capture_output=True, text=True,
                            check=True).stdout
    from gpufleet.inventory.load import data_value

    assert json.loads(theirs) == [data_value(s) for s in samples]


def test_broken_inventory_file_is_one_line(project: Project) -> None:
    project.group_vars("all", BASE)
    project.inventory('servers = ["gpu-1.invalid"]\nraise RuntimeError("no\\nsecond line")')
    result = run_cli("check", "inventories/fleet.py", cwd=project.root)
    assert result.rc == 2 and result.err == "inventories/fleet.py:3: RuntimeError: no\n"


@pytest.mark.parametrize(("body", "expected"), [
    ("import sys\nsys.exit(0)", "inventories/fleet.py: expected the inventory to end with apply_group_vars(globals())"
                                " (gpufleet.inventory.load), found no call\n"),
    ("import sys\nsys.exit(5)", "inventories/fleet.py: expected the inventory to run through, found it exited with"
                                " status 5\n"),
    ("import sys\nsys.exit('inventories/fleet.py: no lab is up')", "inventories/fleet.py: no lab is up\n"),
])
def test_an_inventory_that_exits_early_is_one_line_and_exit_2(project: Project, body: str, expected: str) -> None:
    project.group_vars("all", BASE)
    project.inventory(body)
    result = run_cli("check", "inventories/fleet.py", cwd=project.root)
    assert (result.rc, result.err) == (2, expected)


def test_pyinfra_keys_are_read_from_pyinfra() -> None:
    """The connection keys and global arguments gpufleet accepts are pyinfra's own lists, not a copy."""
    from pyinfra.api.arguments import all_argument_meta
    from pyinfra.connectors.ssh import connector_data_meta

    from gpufleet.config.validate import pyinfra_keys

    assert set(connector_data_meta) <= pyinfra_keys()
    assert {key for key in all_argument_meta if key.startswith("_")} <= pyinfra_keys()
    assert "name" not in pyinfra_keys() and "ssh_usr" not in pyinfra_keys()


@pytest.mark.parametrize(("argv", "line"), [
    (["check", "--bogus", "x"], "gpufleet check: no such option '--bogus' (see gpufleet check --help)"),
    (["check"], "gpufleet check: missing argument 'INVENTORY' (see gpufleet check --help)"),
    (["plan", "--json", "--observed"], "gpufleet plan: missing argument 'INVENTORY' (see gpufleet plan --help)"),
    (["plan", "--facts"], "gpufleet: option '--facts' requires an argument (see gpufleet --help)"),
    (["plnn"], "gpufleet: no such command 'plnn'. Did you mean 'plan'? (see gpufleet --help)"),
    (["check", "a", "b"], "gpufleet check: got unexpected extra argument (b) (see gpufleet check --help)"),
])
def test_a_bad_command_line_is_one_line_and_exit_2(argv: list[str], line: str) -> None:
    from click.testing import CliRunner

    from gpufleet.cli.main import main

    result = CliRunner().invoke(main, argv, prog_name="gpufleet")
    assert (result.exit_code, result.stderr.splitlines()) == (2, [line]), result.output
    assert "Usage:" not in result.output
