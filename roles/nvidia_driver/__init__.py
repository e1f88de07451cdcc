"""Role ``nvidia_driver``: NVIDIA's driver from NVIDIA's CUDA repository, held on one branch.

After it, the node has:

- ``/etc/apt/keyrings/gpufleet-nvidia.gpg`` (or ``.asc``): the repository's key, fetched from
  ``nvidia_repo_keyring_url`` when the keyring there is missing or not exactly the key
  ``nvidia_repo_key_fingerprint`` names (``gpg --show-keys`` on the node, before apt sees it; another key
  stops the node and leaves no keyring behind), and ``/etc/apt/sources.list.d/gpufleet-nvidia.list``:
  ``deb [signed-by=THAT KEYRING] nvidia_repo_url /``; apt trusts that key for that repository only.
  (plain-http URLs pass the config's validation only with ``allow_plain_http``);
- ``/etc/apt/preferences.d/gpufleet-nvidia-driver``: every ``<branch>.*`` version of NVIDIA's driver
  packages (``nvidia-*``, ``libnvidia-*``, ``cuda-drivers*``) is preferred over any other version, so no
  upgrade can leave the branch, and ``/etc/apt/apt.conf.d/51gpufleet-nvidia-driver``: unattended-upgrades
  leaves those packages alone altogether (a driver upgrade needs a reboot; it happens in a deploy);
- the driver package ``nvidia-driver-<branch>-open`` (``nvidia_driver_kernel_modules: open``) or
  ``nvidia-driver-<branch>`` (``proprietary``) at ``nvidia_driver_version``, or, when that is null, the
  branch's newest at the first install, then kept;
- ``nvidia-persistenced`` at the driver's exact version, enabled and running;
- on NVSwitch systems only, ``nvidia-fabricmanager-<branch>`` at the driver's exact version, enabled and
  running. NVSwitch is read from the probed facts (a GPU reports fabric state, or an NVLink ends at a
  switch) or, on a node whose NVML cannot answer yet, from its declared ``gpu_profile`` (``-SXM``);
- a kernel module that matches the driver package: when the version NVML reports (the loaded module)
  differs from the installed package, ``nvidia_driver_reboot`` decides (see :func:`reboot_action`):
  reboot and probe again, or stop the node with ``reboot required: ...``. A stopped node runs no later
  operation of the deploy, so it never serves on a mismatched driver.

Variables (roles/nvidia_driver/defaults.yml): ``nvidia_driver_branch``, ``nvidia_driver_kernel_modules``,
``nvidia_driver_version``, ``nvidia_driver_reboot``, ``nvidia_repo_url``, ``nvidia_repo_keyring_url``,
``nvidia_repo_key_fingerprint``; ``gpu_profile`` and ``allow_plain_http`` (roles/fleet).

apt work is idempotent: the package index is refreshed (for this repository only) when the source or
the key changed or when apt does not know the driver package yet, packages are installed without
``latest``, and services restart only when their package changed.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from time import sleep
from typing import Any, Literal

from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.api.deploy import deploy
from pyinfra.api.facts import FactBase
from pyinfra.api.operation import OperationMeta
from pyinfra.context import host, state
from pyinfra.facts.deb import DebPackages
from pyinfra.facts.server import Command
from pyinfra.operations import apt, files, server, systemd
from pyinfra.operations.util import any_changed

from gpufleet.deploy.context import gpu_facts, host_config
from gpufleet.gpu_facts import NodeFacts, parse_facts
from gpufleet.gpu_probe import NvmlGpuFacts
from gpufleet.hardware_profiles import ProfileError, parse_profile

TEMPLATES = Path(__file__).resolve().parents[2] / "templates" / "nvidia_driver"
KEYRING_DIR = "/etc/apt/keyrings"
SOURCE_FILE = "/etc/apt/sources.list.d/gpufleet-nvidia.list"
PIN_FILE = "/etc/apt/preferences.d/gpufleet-nvidia-driver"
UNATTENDED_FILE = "/etc/apt/apt.conf.d/51gpufleet-nvidia-driver"
PERSISTENCED = "nvidia-persistenced"
# Refresh the lists of NVIDIA's repository only (other sources are neither fetched nor dropped);
# a failed fetch or a bad signature fails the operation instead of leaving stale lists behind.
UPDATE_REPOSITORY = (
    f"apt-get update --error-on=any -o Dir::Etc::SourceList={SOURCE_FILE}"
    " -o Dir::Etc::SourceParts=- -o APT::Get::List-Cleanup=0"
)
REBOOT_TIMEOUT_S = 600

RebootPolicy = Literal["never", "if-needed", "allowed"]
Action = Literal["none", "reboot", "stop"]


def driver_package(branch: int, kernel_modules: str) -> str:
    """The driver package of a branch and kernel module flavour (``nvidia-driver-580-open``)."""
    return f"nvidia-driver-{branch}-open" if kernel_modules == "open" else f"nvidia-driver-{branch}"


def fabricmanager_package(branch: int) -> str:
    return f"nvidia-fabricmanager-{branch}"


def keyring_path(url: str) -> str:
    """Where the repository's key goes: ``.gpg`` for a binary keyring, ``.asc`` for an armored key."""
    suffix = ".gpg" if url.rstrip("/").endswith(".gpg") else ".asc"
    return f"{KEYRING_DIR}/gpufleet-nvidia{suffix}"


def key_fingerprints_command(path_word: str) -> str:
    """Shell printing the fingerprint of each primary key in an OpenPGP key file (armored or binary), one a
    line, from ``gpg --show-keys`` in a throwaway home (nothing is imported anywhere). ``path_word``: the
    file as a shell word (already quoted)."""
    return ('{ home="$(mktemp -d)"; GNUPGHOME="$home" gpg --batch --show-keys --with-colons'
            f" {path_word} 2>/dev/null | awk -F: '/^pub:/{{p=1; next}} /^fpr:/{{if (p) print $10; p=0}}';"
            ' rm -rf "$home"; }')


class KeyFingerprints(FactBase[list[str]]):
    """
    Returns the fingerprints of the primary keys in an OpenPGP key file, armored or binary; [] when the file
    is missing or holds no key:

    .. code:: python

        ["EB693B3035CD5710E231E123A4B469963BF863CC"]
    """

    def command(self, path: str) -> str:
        return f"if [ -f {shlex.quote(path)} ]; then {key_fingerprints_command(shlex.quote(path))}; fi"

    def process(self, output: list[str]) -> list[str]:
        return [line.strip().upper() for line in output if re.fullmatch(r"[0-9A-Fa-f]{40}", line.strip())]


def fetch_key_script(url: str, dest: str, fingerprint: str) -> str:
    """Shell that fetches the key at ``url`` and installs it as ``dest`` only when it holds exactly the key
    ``fingerprint`` names; otherwise it removes ``dest`` (apt must not trust it) and fails, saying why."""
    q = shlex.quote
    before = f"NVIDIA's repository key from {url} has fingerprint(s) "
    after = f", expected {fingerprint} (nvidia_repo_key_fingerprint): not trusted, {dest} removed"
    return "\n".join([
        "set -eu",
        "command -v gpg >/dev/null || { echo 'gpg is needed to check the repository key (install gnupg)' >&2;"
        " exit 1; }",
        'tmp="$(mktemp)"',
        """trap 'rm -f "$tmp"' EXIT""",
        f'curl -fsSL --retry 3 -o "$tmp" {q(url)}',
        f'found="$({key_fingerprints_command(chr(34) + "$tmp" + chr(34))} | paste -sd " " -)"',
        f'if [ "$found" != {q(fingerprint)} ]; then',
        f"  rm -f {q(dest)}",
        f'  printf "%s%s%s\\n" {q(before)} "${{found:-none}}" {q(after)} >&2',
        "  exit 1",
        "fi",
        f'install -m 0644 "$tmp" {q(dest)}',  # as root on the node: root-owned
    ])


@operation()
def repository_key(url: str, dest: str, fingerprint: str) -> Generator[Any, None, None]:
    """
    Keep ``dest`` holding exactly the key ``fingerprint`` names, fetched from ``url`` when it does not; a key
    with another fingerprint stops the node (and ``dest`` is removed, so apt trusts nothing from it).

    + url: where the key is published (https, or http with allow_plain_http, or file)
    + dest: the keyring apt's source names with ``signed-by=``
    + fingerprint: 40 hex digits, upper case
    """
    if host.get_fact(KeyFingerprints, path=dest) == [fingerprint]:
        host.noop(f"{dest} holds the key {fingerprint}")
        return
    yield StringCommand(fetch_key_script(url, dest, fingerprint))


def upstream_version(deb_version: str) -> str:
    """The driver version inside a package version: ``1:580.95.05-1`` -> ``580.95.05``."""
    without_epoch = deb_version.split(":", 1)[-1]
    return without_epoch.rsplit("-", 1)[0] if "-" in without_epoch else without_epoch


def has_nvswitch(facts: NodeFacts | None, declared_profile: str | None) -> bool:
    """Whether the node's GPUs sit on an NVSwitch fabric (and so need the fabric manager).

    From the probed facts: a GPU reports a fabric state other than ``not_supported`` (Hopper and newer),
    or one of its NVLinks ends at a switch (A100 boards too). A node whose NVML cannot answer (no driver
    loaded yet) is judged by its declared profile: ``-SXM`` boards have NVSwitch.
    """
    if facts is not None and facts.nvml.available and facts.gpus:
        for gpu in facts.gpus:
            if gpu.fabric is not None and gpu.fabric.state != "not_supported":
                return True
            if any(link.remote_device_type == "switch" for link in gpu.nvlinks or []):
                return True
        return False
    if declared_profile:
        try:
            return parse_profile(declared_profile).interconnect == "SXM"
        except ProfileError:
            return False
    return False


def module_matches(installed: str, loaded: str | None) -> bool:
    """Whether the loaded kernel module (NVML's driver version) is the installed driver package's."""
    return loaded is not None and upstream_version(installed) == loaded


def reboot_action(installed: str, loaded: str | None, policy: RebootPolicy, changed_now: bool) -> Action:
    """What to do about the kernel module, given the installed driver package and the loaded module.

    ``installed`` is the package version (``580.95.05-1``), ``loaded`` the driver version NVML reports
    (``580.95.05``; None when NVML cannot answer, e.g. no module loaded), ``changed_now`` whether this
    deploy installed or upgraded the driver package. ``none``: they match; ``reboot``: reboot and probe
    again; ``stop``: fail the node with "reboot required".
    """
    if module_matches(installed, loaded):
        return "none"
    if policy == "allowed" or (policy == "if-needed" and changed_now):
        return "reboot"
    return "stop"


@dataclass(frozen=True)
class LoadedModule:
    """The driver version NVML reports (the loaded kernel module's), or why NVML could not say."""

    version: str | None
    why_unknown: str | None = None

    @classmethod
    def of(cls, facts: NodeFacts | None) -> LoadedModule:
        if facts is None:
            return cls(None, "the node could not be probed")
        if not facts.nvml.available:
            return cls(None, f"NVML: {facts.nvml.error or 'unavailable'}")
        return cls(facts.driver_version, None if facts.driver_version else "NVML reported no driver version")

    def __str__(self) -> str:
        if self.version:
            return f"kernel module {self.version} loaded"
        return f"no kernel module loaded ({self.why_unknown})" if self.why_unknown else "no kernel module loaded"


def reboot_required_message(package: str, installed: str, loaded: LoadedModule, policy: str) -> str:
    return f"reboot required: driver package {package} {installed} installed, {loaded} (nvidia_driver_reboot: {policy})"


class AptCandidate(FactBase[str | None]):
    """
    Returns the version apt would install for a package, or None when apt knows no version of it
    (its repository's lists were never fetched):

    .. code:: python

        "580.95.05-1"
    """

    def command(self, package: str) -> str:
        return f"apt-cache policy {shlex.quote(package)} 2>/dev/null | sed -n 's/^ *Candidate: //p'"

    def process(self, output: list[str]) -> str | None:
        version = output[0].strip() if output else ""
        return None if version in ("", "(none)") else version


def _installed_version(package: str) -> str | None:
    """The version dpkg has installed of ``package`` (read now, not when the deploy started)."""
    versions = host.get_fact(DebPackages).get(package)
    return next(iter(versions)) if versions else None  # dpkg installs one version of a package


def _fail(message: str) -> StringCommand:
    """A command that fails with ``message`` on stderr: pyinfra shows it and stops the host."""
    return StringCommand(f"echo {shlex.quote(message)} >&2; exit 1")


@operation()
def packages_at_driver_version(packages: list[str], driver: str) -> Generator[Any, None, None]:
    """
    Install packages at exactly the installed driver package's version (read when the operation runs,
    after the driver's own install).

    + packages: packages whose versions must equal the driver's (fabric manager, persistence daemon)
    + driver: the driver package
    """
    version = _installed_version(driver)
    if version is None:
        if state.is_executing:
            yield _fail(f"driver package {driver} is not installed; cannot match {' '.join(packages)} to it")
        return  # before the deploy runs: the driver's version is not known yet
    yield from apt.packages._inner(packages=[f"{name}={version}" for name in packages], allow_downgrades=True)


def _boot_id(node: Any) -> str:
    return node.get_fact(Command, "cat /proc/sys/kernel/random/boot_id")


@operation(is_idempotent=False)
def reboot(timeout: int = REBOOT_TIMEOUT_S) -> Generator[Any, None, None]:
    """
    Reboot the node and wait until it answers again from a new boot.

    A new boot is a new ``/proc/sys/kernel/random/boot_id`` (set by the kernel at boot, and by
    systemd-nspawn for each container boot, where the host's uptime would not change).

    + timeout: seconds to wait for the node to come back
    """
    before: list[str] = []

    def note_boot(state: Any, host: Any) -> bool:
        before.append(_boot_id(host))
        return True

    def wait_for_new_boot(state: Any, host: Any) -> bool:
        sleep(3)
        host.disconnect()
        for _ in range(timeout):
            host.connect(show_errors=False)
            if host.connected:
                try:
                    if _boot_id(host) not in ("", before[0]):
                        return True
                except Exception:  # the connection dropped while the node went down
                    pass
                host.disconnect()
            sleep(1)
        raise TimeoutError(f"the node did not come back within {timeout} s of its reboot")

    yield FunctionCommand(note_boot, (), {})
    yield StringCommand("( sleep 1 && systemctl reboot ) </dev/null >/dev/null 2>&1 &")
    yield FunctionCommand(wait_for_new_boot, (), {})


@operation()
def kernel_module_matches(
    driver: str, loaded: LoadedModule, policy: RebootPolicy, driver_install: OperationMeta
) -> Generator[Any, None, None]:
    """
    Make sure the loaded kernel module is the installed driver's: nothing to do, reboot and probe
    again, or stop the node with "reboot required" (see :func:`reboot_action`).

    + driver: the driver package
    + loaded: what NVML reported when the deploy started
    + policy: ``nvidia_driver_reboot``
    + driver_install: the operation that installs the driver package (did it change the package?)
    """
    installed = _installed_version(driver)
    if installed is None:
        if state.is_executing:
            yield _fail(f"driver package {driver} is not installed")
        return
    changed_now = driver_install.did_change() if driver_install.is_complete() else bool(driver_install.will_change)
    action = reboot_action(installed, loaded.version, policy, changed_now)
    if action == "none":
        host.noop(f"{loaded}, driver package {driver} {installed}")
        return
    if action == "stop":
        yield _fail(reboot_required_message(driver, installed, loaded, policy))
        return
    yield from reboot._inner()
    after = LoadedModule.of(_probe_again())
    if not module_matches(installed, after.version):
        yield _fail(f"reboot did not help: driver package {driver} {installed} installed, {after} after the reboot")


def _probe_again() -> NodeFacts | None:
    """The node's facts probed again (None when the probe fails or its facts do not parse)."""
    try:
        return parse_facts(host.get_fact(NvmlGpuFacts), f"{host.name}: probe after the reboot")
    except Exception:
        return None


@deploy("NVIDIA driver")
def nvidia_driver() -> None:
    """Converge NVIDIA's repository, the pinned driver branch, persistenced, fabric manager, and the kernel module."""
    cfg = host_config()
    facts = gpu_facts()
    branch = cfg.nvidia_driver_branch
    driver = driver_package(branch, cfg.nvidia_driver_kernel_modules)
    keyring = keyring_path(cfg.nvidia_repo_keyring_url)
    files.directory(
        name=f"Create apt's keyring directory {KEYRING_DIR}",
        path=KEYRING_DIR, user="root", group="root", mode="0755",
    )
    key = repository_key(
        name=f"Fetch the NVIDIA repository's key to {keyring}, checked against its fingerprint",
        url=cfg.nvidia_repo_keyring_url, dest=keyring, fingerprint=cfg.nvidia_repo_key_fingerprint,
    )
    source = files.template(
        name=f"Add NVIDIA's repository, trusted through {keyring} only",
        src=str(TEMPLATES / "gpufleet-nvidia.list.j2"), dest=SOURCE_FILE,
        user="root", group="root", mode="0644",
        repo_url=cfg.nvidia_repo_url, keyring=keyring,
    )
    files.template(
        name=f"Pin NVIDIA's driver packages to branch {branch}",
        src=str(TEMPLATES / "gpufleet-nvidia-driver.pref.j2"), dest=PIN_FILE,
        user="root", group="root", mode="0644",
        branch=branch,
    )
    files.template(
        name="Keep unattended-upgrades away from NVIDIA's driver packages",
        src=str(TEMPLATES / "51gpufleet-nvidia-driver.conf.j2"), dest=UNATTENDED_FILE,
        user="root", group="root", mode="0644",
    )
    # apt must know the driver package: refresh when the source or key changed, or when it never did.
    known = host.get_fact(AptCandidate, package=driver) is not None
    server.shell(
        name="Refresh the package lists of NVIDIA's repository",
        commands=[UPDATE_REPOSITORY],
        _if=[any_changed(key, source)] if known else [],
    )

    version = cfg.nvidia_driver_version
    installed = apt.packages(
        name=f"Install the driver package {driver}" + (f" {version}" if version else ""),
        packages=[f"{driver}={version}" if version else driver],
        latest=False,
        allow_downgrades=bool(version),
    )
    persistenced = packages_at_driver_version(
        name=f"Install {PERSISTENCED} at the driver's version",
        packages=[PERSISTENCED], driver=driver,
    )
    fabric = has_nvswitch(facts, cfg.gpu_profile)
    if fabric:
        fabricmanager = packages_at_driver_version(
            name=f"Install {fabricmanager_package(branch)} at the driver's version (NVSwitch system)",
            packages=[fabricmanager_package(branch)], driver=driver,
        )

    kernel_module_matches(
        name="Check that the loaded kernel module is the installed driver's",
        driver=driver, loaded=LoadedModule.of(facts), policy=cfg.nvidia_driver_reboot, driver_install=installed,
    )

    _service(PERSISTENCED, changed=persistenced)
    if fabric:
        _service("nvidia-fabricmanager", changed=fabricmanager)


def _service(name: str, changed: OperationMeta) -> None:
    """Restart ``name`` when its package changed (start it, if it was not running), then keep it enabled and running."""
    systemd.service(
        name=f"Restart {name}: its package changed",
        service=f"{name}.service", running=True, restarted=True,
        _if=changed.did_change,
    )
    systemd.service(
        name=f"Enable and start {name}",
        service=f"{name}.service", running=True, enabled=True,
    )
