"""Where the lab keeps its files and what it remembers about a running lab.

The state file (``<lab dir>/state.json``) is written before anything is started and updated as
nodes come up, so ``down()`` can undo a half-finished ``up()``. Every process is recorded with its
start time: a PID alone could be reused by an unrelated process after the lab's one exited.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpufleet_lab.errors import LabError

DEFAULT_LAB_DIR = Path("/var/lib/gpufleet-lab")
DEFAULT_CACHE_DIR = Path("/var/cache/gpufleet-lab")
LAB_DIR_ENV = "GPUFLEET_LAB_DIR"
CACHE_DIR_ENV = "GPUFLEET_LAB_CACHE"
STATE_VERSION = 2


def lab_dir() -> Path:
    """The running lab's directory: ``$GPUFLEET_LAB_DIR`` or ``/var/lib/gpufleet-lab``."""
    return Path(os.environ.get(LAB_DIR_ENV) or DEFAULT_LAB_DIR)


def cache_dir() -> Path:
    """Where built rootfs images are kept between labs: ``$GPUFLEET_LAB_CACHE`` or ``/var/cache/gpufleet-lab``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR)


def state_path(base: Path | None = None) -> Path:
    return (base or lab_dir()) / "state.json"


def ssh_key_path(base: Path | None = None) -> Path:
    """The lab's private SSH key (ed25519); the public half sits beside it with ``.pub``."""
    return (base or lab_dir()) / "ssh" / "id_ed25519"


def known_hosts_path(base: Path | None = None) -> Path:
    """The running lab's nodes' host keys, by address and by name (for strict host key checking)."""
    return (base or lab_dir()) / "ssh" / "known_hosts"


def ssh_config_path(base: Path | None = None) -> Path:
    """An OpenSSH client config for the running lab: ``ssh -F <this> lab1``."""
    return (base or lab_dir()) / "ssh" / "config"


@dataclass
class ProcessRecord:
    """A process the lab started (or found as the child of one), identified by PID and start time."""

    pid: int
    start_ticks: int


@dataclass
class NodeRecord:
    """One lab node as ``up()`` made it."""

    name: str  # hostname: lab1, lab2, ...
    machine: str  # systemd-nspawn machine name (names the host-side veth)
    address: str
    profile: str
    node_dir: str  # holds the rootfs (or overlay layers) and the console log
    root: str  # the directory the container boots from
    mounted: bool = False  # root is an overlay mount the lab must unmount
    process: ProcessRecord | None = None  # the supervisor that runs (and reruns) the node's systemd-nspawn


@dataclass
class LabState:
    """The running lab: its network, its key and its nodes."""

    subnet: str
    bridge: str
    bridge_address: str
    ssh_key: str
    known_hosts: str
    ssh_config: str
    base_rootfs: str
    bridge_created: bool = False
    mirror_started: bool = False
    nodes: list[NodeRecord] = field(default_factory=list)
    version: int = STATE_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> LabState:
        raw = json.loads(text)
        if raw.get("version") != STATE_VERSION:
            raise LabError(f"lab state has version {raw.get('version')!r}, this gpufleet reads {STATE_VERSION}")
        nodes = []
        for n in raw.pop("nodes", []):
            if n.get("process") is not None:
                n["process"] = ProcessRecord(**n["process"])
            nodes.append(NodeRecord(**n))
        return cls(nodes=nodes, **raw)


def load_state(base: Path | None = None) -> LabState | None:
    """The running lab's state, or None when no lab is up."""
    path = state_path(base)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        return LabState.from_json(text)
    except (ValueError, TypeError, KeyError) as exc:
        raise LabError(f"cannot read the lab state {path}: {exc}") from exc


def save_state(state: LabState, base: Path | None = None) -> None:
    """Write the state atomically (readers never see half a file)."""
    path = state_path(base)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(state.to_json())
    os.replace(tmp, path)


def remove_state(base: Path | None = None) -> None:
    state_path(base).unlink(missing_ok=True)


@contextlib.contextmanager
def locked(base: Path | None = None) -> Iterator[None]:
    """Hold the lab's lock: one ``up``/``down`` at a time per lab directory."""
    directory = base or lab_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LabError(f"another lab operation holds {directory / '.lock'}; wait for it to finish") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
