"""The lab's pure parts, without root or a running lab: addresses, profiles, state, cache key, CLI errors."""

from __future__ import annotations

import ipaddress
import runpy
from pathlib import Path

import pytest
from click.testing import CliRunner
from gpufleet_lab import mirror, network, nodes, preflight, rootfs, supervise, tiny_model
from gpufleet_lab.cli import lab_group
from gpufleet_lab.errors import LabError
from gpufleet_lab.state import CACHE_DIR_ENV, LabState, NodeRecord, ProcessRecord, load_state, save_state
from gpufleet_lab.tiny_adapters import LAB_ADAPTERS, LATER_ADAPTER, SUMS_FILE, WEIGHTS_FILE

ROOT = Path(__file__).resolve().parents[3]


def test_addresses_start_at_dot_11_after_the_bridge() -> None:
    net = network.parse_subnet("10.213.0.0/24")
    assert str(network.bridge_address(net)) == "10.213.0.1"
    assert [str(a) for a in network.node_addresses(net, 3)] == ["10.213.0.11", "10.213.0.12", "10.213.0.13"]
    # the routers' virtual address: on the bridge's network, neither the bridge's nor any node's
    assert str(network.virtual_address(net)) == "10.213.0.10"


@pytest.mark.parametrize(
    ("cidr", "count", "message"),
    [
        ("10.213.0.0/29", 1, "holds 0 lab nodes"),
        ("10.213.0.1/24", 1, "is not an IPv4 network"),
        ("8.8.8.0/24", 1, "not a private range"),
        ("10.213.0.0/24", 245, "holds 244 lab nodes"),
    ],
)
def test_bad_subnets_say_why(cidr: str, count: int, message: str) -> None:
    with pytest.raises(LabError, match=message):
        network.node_addresses(network.parse_subnet(cidr), count)


def test_node_network_config_has_an_address_and_no_gateway() -> None:
    net = ipaddress.IPv4Network("10.213.0.0/24")
    text = network.networkd_config(ipaddress.IPv4Address("10.213.0.12"), net)
    assert "Name=host0" in text and "Address=10.213.0.12/24" in text
    assert "Gateway" not in text and "IPv6AcceptRA=no" in text


def test_profiles_one_for_all_or_one_each() -> None:
    assert nodes.resolve_profiles(3, None) == ["8xH100-SXM"] * 3
    assert nodes.resolve_profiles(2, ["8xL40S-PCIe"]) == ["8xL40S-PCIe"] * 2
    assert nodes.resolve_profiles(2, ["8xH100-SXM", "2xRTX4090"]) == ["8xH100-SXM", "2xRTX4090"]
    with pytest.raises(LabError, match="one per node"):
        nodes.resolve_profiles(3, ["8xH100-SXM", "2xRTX4090"])
    with pytest.raises(LabError, match="unknown GPU"):
        nodes.resolve_profiles(1, ["8xB999-SXM"])


def test_bridge_names_must_be_interface_names() -> None:
    assert network.check_bridge_name("gflab0") == "gflab0"
    for bad in ("", "0lab", "a-name-too-long-x", "br 0"):
        with pytest.raises(LabError):
            network.check_bridge_name(bad)


def test_cache_key_follows_the_package_list() -> None:
    base = rootfs.cache_key()
    assert rootfs.cache_key(tuple(reversed(rootfs.BASE_PACKAGES))) == base
    assert rootfs.cache_key((*rootfs.BASE_PACKAGES, "less")) != base


def _state(tmp_path: Path) -> LabState:
    return LabState(
        subnet="10.213.0.0/24", bridge="gflab0", bridge_address="10.213.0.1",
        ssh_key=str(tmp_path / "ssh" / "id_ed25519"), known_hosts=str(tmp_path / "ssh" / "known_hosts"),
        ssh_config=str(tmp_path / "ssh" / "config"), base_rootfs="/var/cache/gpufleet-lab/bookworm-x",
        nodes=[
            NodeRecord("lab1", "gflab0-lab1", "10.213.0.11", "8xH100-SXM", "/n/lab1", "/n/lab1/root", True,
                       ProcessRecord(100, 5)),
            NodeRecord("lab2", "gflab0-lab2", "10.213.0.12", "8xH100NVL-PCIe", "/n/lab2", "/n/lab2/root"),
        ],
    )


def test_state_survives_a_round_trip(tmp_path: Path) -> None:
    state = _state(tmp_path)
    save_state(state, tmp_path)
    assert load_state(tmp_path) == state
    assert load_state(tmp_path / "elsewhere") is None


def test_lab_inventory_lists_the_running_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_state(_state(tmp_path), tmp_path)
    monkeypatch.setenv("GPUFLEET_LAB_DIR", str(tmp_path))
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))  # not this machine's lab cache (its key needs gpg)
    tiny_model.make_tiny_model(tmp_path / "cache" / "models" / "tiny-llama")  # the model the inventory names
    inventory = runpy.run_path(str(ROOT / "inventories" / "lab" / "inventory.py"))
    everyone, group_data = inventory["lab"]
    assert everyone == ["10.213.0.11", "10.213.0.12"]
    hosts, _ = inventory["lab_single"]  # two nodes: no pipeline pair
    assert [h for h, _ in hosts] == ["10.213.0.11", "10.213.0.12"] and "lab_pipeline" not in inventory
    data = dict(hosts[1][1])
    assert data["ssh_user"] == "root" and data["ssh_key"].endswith("id_ed25519")
    assert data["ssh_known_hosts_file"].endswith("known_hosts") and data["gpu_profile"] == "8xH100NVL-PCIe"
    assert group_data["fleet_interface"] == "host0"  # from inventories/lab/group_vars/lab.yml


def test_lab_inventory_without_a_lab_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFLEET_LAB_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match="no lab is up"):
        runpy.run_path(str(ROOT / "inventories" / "lab" / "inventory.py"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["up", "--profile", "8xFOO"], "unknown GPU 'FOO'"),
        (["up", "--nodes", "2", "--profile", "8xH100-SXM", "--profile", "8xH100-SXM", "--profile", "2xRTX4090"],
         "one per node"),
        (["up", "--bridge", "not a name"], "not an interface name"),
    ],
)
def test_cli_errors_are_one_line_without_traceback(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(preflight, "problems", list)
    result = CliRunner().invoke(lab_group, args)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("gpufleet lab: ")
    assert "Traceback" not in result.output


def test_cli_refuses_to_run_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    result = CliRunner().invoke(lab_group, ["up"])
    assert result.exit_code == 1
    assert result.output.strip() == (
        "gpufleet lab: the lab needs root (it mounts, creates a bridge and boots containers); run it as root"
    )


def test_cli_status_without_a_lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFLEET_LAB_DIR", str(tmp_path))
    result = CliRunner().invoke(lab_group, ["status", "--json"])
    assert result.exit_code == 0 and result.output.strip() == "null"


MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
42 23 0:39 / /proc rw,nosuid - proc proc rw
"""


def test_a_node_gets_cgroups_of_its_own_in_the_hierarchies_systemd_uses() -> None:
    """The supervisor moves a node into gpufleet-lab/<machine> of cgroup2 and of v1's name=systemd (a hybrid
    host's two), not of the v1 controllers'; the machine is nspawn's --machine=."""
    assert supervise.systemd_hierarchies(MOUNTINFO) == [Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified")]
    pure_v2 = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    assert supervise.systemd_hierarchies(pure_v2) == [Path("/sys/fs/cgroup")]
    argv = ["systemd-nspawn", "--directory=/x", "--machine=gflabt3-lab2", "--boot"]
    assert supervise.machine_of(argv) == "gflabt3-lab2" and supervise.machine_of(["true"]) is None


def test_a_nodes_cgroup_tree_is_removed_deepest_first(tmp_path: Path) -> None:
    top = tmp_path / "gflabt3-lab2"
    (top / "payload" / "system.slice" / "vllm@x.service").mkdir(parents=True)
    (top / "supervisor").mkdir()
    supervise.clear_children([top])
    assert top.is_dir() and list(top.iterdir()) == []  # the node's own cgroup stays: the supervisor is in it
    assert supervise.remove_tree(top) and not top.exists()
    (top / "busy").mkdir(parents=True)
    (top / "busy" / "cgroup.procs").write_text("1\n")  # a cgroup that still has processes is not removed
    assert not supervise.remove_tree(top, wait_s=0.3) and (top / "busy").is_dir()


def test_the_lab_inventory_declares_one_adapter_more_or_a_new_revision_by_name(tmp_path: Path) -> None:
    """GPUFLEET_LAB_ADAPTERS's items: a name the mirror made besides the declared ones, or NAME=MADE (NAME declared
    with MADE's files, a new revision of NAME: tests/lab/test_faults.py's group change)."""
    root = tmp_path / mirror.ADAPTERS_DIR
    root.mkdir()
    made = [a.name for a in (*LAB_ADAPTERS, LATER_ADAPTER)]
    (root / SUMS_FILE).write_text("".join(f"{str(i) * 64}  {name}/{WEIGHTS_FILE}\n" for i, name in enumerate(made)))
    plain = mirror.adapter_sources("", tmp_path)["vllm_lora_adapters"]
    assert isinstance(plain, dict) and sorted(plain) == sorted(a.name for a in LAB_ADAPTERS)
    revised = mirror.adapter_sources(f"{LATER_ADAPTER.name},tiny-poet={LATER_ADAPTER.name}", tmp_path)
    adapters = revised["vllm_lora_adapters"]
    assert isinstance(adapters, dict) and sorted(adapters) == sorted(made)
    assert adapters["tiny-poet"] == adapters[LATER_ADAPTER.name] == {
        "source": str(root / LATER_ADAPTER.name), "sha256": str(made.index(LATER_ADAPTER.name)) * 64}
    assert adapters["tiny-coder"] == plain["tiny-coder"]
    # a revision of an adapter the pool does not declare declares nothing
    assert "tiny-nobody" not in mirror.adapter_sources("tiny-nobody=tiny-chef", tmp_path)["vllm_lora_adapters"]
