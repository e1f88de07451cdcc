"""Bring the lab's nodes up, report on them, take them down.

``up`` builds (or reuses) the cached base rootfs, creates the bridge, gives every node an overlay
of the base with its own identity, boots each with ``systemd-nspawn -b`` and waits until systemd
reports ``running`` (or ``degraded``) over SSH. ``down`` stops only the processes ``up`` recorded,
unmounts and deletes what it created and removes the bridge. A failed ``up`` takes down what it
had started before raising.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import paramiko

from gpufleet.gpu.profiles import ProfileError, parse_profile
from gpufleet_lab import container, hooks, network, preflight, rootfs, ssh
from gpufleet_lab.errors import LabError
from gpufleet_lab.node_files import write_node_files
from gpufleet_lab.state import (
    LabState,
    NodeRecord,
    cache_dir,
    known_hosts_path,
    lab_dir,
    load_state,
    locked,
    remove_state,
    save_state,
    ssh_config_path,
    ssh_key_path,
)

log = logging.getLogger(__name__)

DEFAULT_PROFILE = "8xH100-SXM"
READY_STATES = ("running", "degraded")
NSPAWN_PROPAGATE = "/run/systemd/nspawn/propagate"  # where nspawn keeps each machine's mount propagation
BOOT_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
LINK_DOWN_S = 0.5  # power_off: the node takes its link down this long after it is asked (its answer gets out)
MODEL_DISK = "models"  # in a node's directory: its model directory's own filesystem (container.start)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def node_names(count: int) -> list[str]:
    return [f"lab{i}" for i in range(1, count + 1)]


def resolve_profiles(count: int, profiles: list[str] | None) -> list[str]:
    """One profile per node: none given means the default for all, one means that one for all."""
    chosen = list(profiles or [DEFAULT_PROFILE])
    if len(chosen) == 1:
        chosen *= count
    if len(chosen) != count:
        raise LabError(f"give one --profile for all nodes or one per node: {count} nodes, {len(chosen)} profiles")
    for name in chosen:
        try:
            parse_profile(name)
        except ProfileError as exc:
            raise LabError(str(exc)) from None
    return chosen


API_KEY_FILE = "vllm-api-key"
RAY_TOKEN_FILE = "ray-auth-token"
CLIENT_KEY_FILE = "router-client-key"  # the key of the routers' client "lab" (router_clients)
BENCH_KEY_FILE = "router-bench-key"  # the key of the routers' client "bench", without limits (gpufleet bench's)
METERED_KEY_FILE = "router-metered-key"  # the key of the routers' client "metered", with a token budget
METERED_TOKENS_PER_MINUTE = 1000  # its budget
DAILY_KEY_FILE = "router-daily-key"  # the key of the routers' client "daily", with a day's token budget only
DAILY_TOKENS_PER_DAY = 10_000_000  # its budget: far above what the tests send
VRRP_PASSWORD_FILE = "vrrp-password"  # the routers' VRRP group (router_vrrp_password: at most 8 characters)
# a stand-in hub token (vllm_hf_token): the lab's model is pushed, so no node downloads with it and it goes nowhere;
# set so that the lab holds every secret a fleet can (gpufleet diag's archive is searched for each)
HUB_TOKEN_FILE = "hub-token"
TLS_DIR = "tls"  # the lab CA and the routers' certificate (gpufleet_lab.tls)


def ensure_api_key(directory: Path, name: str = API_KEY_FILE, nbytes: int = 32) -> Path:
    """A lab secret (0600, made once) of ``nbytes`` random bytes, URL-safe: the vLLM API key, or by ``name`` the
    Ray cluster token, the routers' client key or their VRRP password; the inventory refers to it as
    ``{file: ...}``."""
    path = directory / name
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(nbytes) + "\n")
    return path


def up(
    nodes: int = 3,
    profiles: list[str] | None = None,
    subnet: str = network.DEFAULT_SUBNET,
    *,
    bridge: str = network.DEFAULT_BRIDGE,
    base: Path | None = None,
    root_mode: rootfs.RootMode = "overlay",
    start_mirror: bool = True,
    timeout: float = BOOT_TIMEOUT_S,
) -> LabState:
    """Boot ``nodes`` lab nodes and return the lab's state once every node answers over SSH."""
    preflight.require()
    if nodes < 1:
        raise LabError(f"--nodes must be at least 1, found {nodes}")
    chosen = resolve_profiles(nodes, profiles)
    network.check_bridge_name(bridge)
    net = network.parse_subnet(subnet)
    addresses = network.node_addresses(net, nodes)
    directory = base or lab_dir()
    with locked(directory):
        previous = load_state(directory)
        if previous is not None:
            if any(container.alive(n.process) for n in previous.nodes):
                raise LabError(f"a lab of {len(previous.nodes)} nodes is already up; run `gpufleet lab down` first")
            log.warning("cleaning up a lab that is no longer running")
            _teardown(previous, directory)
        network.check_subnet_free(net, bridge)
        base_root = rootfs.ensure_base(cache_dir())
        key = ssh.ensure_key(ssh_key_path(directory))
        ensure_api_key(directory)
        ensure_api_key(directory, RAY_TOKEN_FILE)
        state = LabState(
            subnet=str(net), bridge=bridge, bridge_address=str(network.bridge_address(net)),
            ssh_key=str(key), known_hosts=str(known_hosts_path(directory)),
            ssh_config=str(ssh_config_path(directory)), base_rootfs=str(base_root),
        )
        save_state(state, directory)
        try:
            _start(state, directory, chosen, addresses, net, root_mode, start_mirror, timeout)
        except BaseException:
            _teardown(state, directory)
            raise
        return state


def _start(
    state: LabState,
    directory: Path,
    profiles: list[str],
    addresses: list[ipaddress.IPv4Address],
    net: ipaddress.IPv4Network,
    root_mode: rootfs.RootMode,
    start_mirror: bool,
    timeout: float,
) -> None:
    if network.host_forwards_ipv4():
        log.warning("this host forwards IPv4 (net.ipv4.ip_forward=1): lab nodes get no gateway, but a node's"
                    " root could add one through %s", state.bridge_address)
    network.create_bridge(state.bridge, net)
    state.bridge_created = True
    save_state(state, directory)
    if start_mirror:
        # The apt/wheel mirror listens on the bridge address; nodes reach nothing else.
        hooks.start_mirror(state.bridge_address)
        state.mirror_started = True
        save_state(state, directory)
    names = node_names(len(profiles))
    lab_nodes = dict(zip(names, addresses, strict=True))
    public_key = Path(state.ssh_key).with_suffix(".pub").read_text()
    host_keys: dict[tuple[str, str], str] = {}
    for name, address, profile in zip(names, addresses, profiles, strict=True):
        node_dir = directory / "nodes" / name
        node = NodeRecord(name=name, machine=f"{state.bridge}-{name}", address=str(address), profile=profile,
                          node_dir=str(node_dir), root=str(node_dir / "root"))
        state.nodes.append(node)
        prepared = rootfs.prepare_node_root(Path(state.base_rootfs), node_dir, root_mode)
        node.mounted = prepared.mounted
        save_state(state, directory)
        host_keys[(name, node.address)] = write_node_files(prepared.root, name, address, net, lab_nodes, public_key)
        hooks.install_sim_profile(prepared.root, profile, name)
        hooks.install_debian_source(prepared.root, state.bridge_address)
    known_hosts, key = Path(state.known_hosts), Path(state.ssh_key)
    ssh.write_known_hosts(known_hosts, host_keys)
    ssh.write_client_config(Path(state.ssh_config), {n.name: n.address for n in state.nodes}, key, known_hosts)
    for node in state.nodes:
        node.process = container.start(Path(node.root), node.machine, node.name, state.bridge,
                                       Path(node.node_dir) / "console.log", Path(node.node_dir) / MODEL_DISK)
        save_state(state, directory)
    with ThreadPoolExecutor(max_workers=len(state.nodes)) as pool:
        list(pool.map(lambda n: _wait_ready(n, key, known_hosts, timeout), state.nodes))


def _wait_ready(node: NodeRecord, key: Path, known_hosts: Path, timeout: float) -> None:
    """Wait until the node's systemd says running/degraded over SSH; raise with the console's tail if not."""
    deadline = time.monotonic() + timeout
    last = "no answer on port 22"
    while time.monotonic() < deadline:
        if not container.alive(node.process):
            raise LabError(f"{node.name} stopped while booting: {_console_tail(node)}")
        if ssh.port_answers(node.address):
            try:
                _, out = ssh.run(node.address, key, known_hosts, "systemctl is-system-running")
                last = out.strip() or last
                if last in READY_STATES:
                    if last == "degraded":
                        _, failed = ssh.run(node.address, key, known_hosts, "systemctl --failed --plain --no-legend")
                        log.warning("%s booted degraded; failed units: %s", node.name, failed.strip())
                    return
            except (OSError, paramiko.SSHException) as exc:
                last = f"ssh: {exc}"
        time.sleep(0.25)
    raise LabError(f"{node.name} ({node.address}) not ready after {timeout:.0f} s ({last}): {_console_tail(node)}")


def _console_tail(node: NodeRecord, lines: int = 3) -> str:
    try:
        text = (Path(node.node_dir) / "console.log").read_text(errors="replace")
    except FileNotFoundError:
        return "no console log"
    tail = [line.strip() for line in _ANSI.sub("", text).splitlines() if line.strip()][-lines:]
    return " | ".join(tail) or "console empty"


@dataclass(frozen=True)
class NodeStatus:
    """What ``status`` reports per node."""

    name: str
    address: str
    profile: str
    process_alive: bool
    ssh_answers: bool

    @property
    def up(self) -> bool:
        return self.process_alive and self.ssh_answers


@dataclass(frozen=True)
class LabStatus:
    subnet: str
    bridge: str
    bridge_address: str
    ssh_key: str
    ssh_config: str
    nodes: list[NodeStatus]


def status(base: Path | None = None) -> LabStatus | None:
    """The running lab's nodes and whether each is up; None when no lab is up."""
    state = load_state(base or lab_dir())
    if state is None:
        return None
    return LabStatus(
        subnet=state.subnet, bridge=state.bridge, bridge_address=state.bridge_address, ssh_key=state.ssh_key,
        ssh_config=state.ssh_config,
        nodes=[
            NodeStatus(n.name, n.address, n.profile, container.alive(n.process),
                       container.alive(n.process) and ssh.port_answers(n.address))
            for n in state.nodes
        ],
    )


@contextmanager
def _one_node(name: str, base: Path | None) -> Iterator[tuple[LabState, NodeRecord]]:
    """The lab's state and its node ``name``, under the lab's lock; the state is saved when the block ends."""
    directory = base or lab_dir()
    with locked(directory):
        state = load_state(directory)
        if state is None:
            raise LabError(f"no lab is up in {directory}")
        found = [n for n in state.nodes if n.name == name]
        if not found:
            raise LabError(f"no lab node {name!r} (nodes: {', '.join(n.name for n in state.nodes)})")
        yield state, found[0]
        save_state(state, directory)


def power_off(name: str, base: Path | None = None) -> float:
    """Cut one node's power, as a node lost to a hardware or power fault: its link goes down first (nothing more
    leaves it, not even the resets of its closing connections), then it is killed without a shutdown. Returns the
    monotonic clock's reading at or before the moment the link went down (the cut, for figures measured from it)."""
    with _one_node(name, base) as (state, node):
        asked = time.monotonic()  # the node runs the command after this, and takes its link down LINK_DOWN_S later
        _, peer = ssh.run(node.address, Path(state.ssh_key), Path(state.known_hosts),
                          "cat /sys/class/net/host0/iflink;"
                          f" nohup sh -c 'sleep {LINK_DOWN_S}; ip link set host0 down' >/dev/null 2>&1 &")
        time.sleep(1.5)
        container.stop([(node.process, Path(node.root))], grace=0)
        node.process = None
        veth = network.link_with_index(int(peer.strip())) if peer.strip().isdigit() else None
        if veth is not None:  # a killed nspawn leaves its veth behind, and the next boot could not add it
            network.delete_link(veth)
        shutil.rmtree(Path(NSPAWN_PROPAGATE) / node.machine, ignore_errors=True)  # and its mount propagation dir
    return asked + LINK_DOWN_S


def power_on(name: str, base: Path | None = None, timeout: float = 120) -> None:
    """Boot a node that was powered off again, and wait until its systemd is up."""
    with _one_node(name, base) as (state, node):
        if container.alive(node.process):
            raise LabError(f"{name} is running")
        node.process = container.start(Path(node.root), node.machine, node.name, state.bridge,
                                       Path(node.node_dir) / "console.log", Path(node.node_dir) / MODEL_DISK)
    _wait_ready(node, Path(state.ssh_key), Path(state.known_hosts), timeout)


def down(base: Path | None = None) -> LabState | None:
    """Power off every node the lab started (at once: their roots are deleted) and remove its network and files;
    the state it took down, or None."""
    preflight.require()
    directory = base or lab_dir()
    with locked(directory):
        state = load_state(directory)
        if state is None:
            return None
        _teardown(state, directory)
        return state


def _teardown(state: LabState, directory: Path) -> None:
    """Undo ``up`` in reverse, from whatever the state recorded; safe to call on a half-built lab."""
    # The nodes' roots go right after: nothing on them needs a clean shutdown, which would wait on every unit
    # (vLLM drains, Ray stops) for tens of seconds.
    survivors = container.stop([(n.process, Path(n.root)) for n in state.nodes], STOP_TIMEOUT_S, cut_power=True)
    if survivors:
        raise LabError(f"processes {', '.join(map(str, survivors))} survived SIGKILL; the lab is not down")
    # Each node wrote a few GB in a hundred thousand files (vLLM's venvs): deleted side by side.
    with ThreadPoolExecutor(max_workers=max(1, len(state.nodes))) as pool:
        list(pool.map(lambda n: rootfs.release_node_root(Path(n.node_dir), Path(n.root)), state.nodes))
    if state.mirror_started:
        hooks.stop_mirror(state.bridge_address)
    if state.bridge_created:
        network.delete_bridge(state.bridge)
    Path(state.known_hosts).unlink(missing_ok=True)
    Path(state.ssh_config).unlink(missing_ok=True)
    remove_state(directory)
    nodes_dir = directory / "nodes"
    if nodes_dir.is_dir() and not any(nodes_dir.iterdir()):
        nodes_dir.rmdir()
