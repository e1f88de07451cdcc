"""NVIDIA's driver on a node: the repository key checked by fingerprint, package lists refreshed when needed,
companion packages held at the driver's exact version, and a loaded kernel module that matches the package."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pyinfra.api.command import StringCommand
from pyinfra.api.operation import OperationMeta
from pyinfra.context import host, state

from gpufleet.facts.apt import AptCandidate
from gpufleet.facts.gpu import NvmlGpuFacts
from gpufleet.facts.nvidia import KeyFingerprints, key_fingerprints_command
from gpufleet.gpu.report import NodeFacts, parse_facts
from gpufleet.operations import apt, node, server
from gpufleet.operations.node import Commands, fail, gpufleet_operation

RebootPolicy = Literal["never", "if-bare", "if-needed", "allowed"]
Action = Literal["none", "reboot", "stop"]


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




@gpufleet_operation()
def repository_key(url: str, dest: str, fingerprint: str) -> Commands:
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



def module_matches(installed: str, loaded: str | None) -> bool:
    """Whether the loaded kernel module (NVML's driver version) is the installed driver package's."""
    return loaded is not None and upstream_version(installed) == loaded


def reboot_action(installed: str, loaded: str | None, policy: RebootPolicy, changed_now: bool) -> Action:
    """What to do about the kernel module, given the installed driver package and the loaded module.

    ``installed`` is the package version (``580.95.05-1``), ``loaded`` the driver version NVML reports
    (``580.95.05``; None when NVML cannot answer, e.g. no module loaded), ``changed_now`` whether this
    deploy installed or upgraded the driver package. ``none``: they match; ``reboot``: reboot and probe
    again; ``stop``: fail the node with "reboot required". ``if-bare`` reboots only a node this deploy gave its
    first driver (no module loaded, even after the install): nothing can have been serving there.
    """
    if module_matches(installed, loaded):
        return "none"
    if policy == "allowed" or (policy == "if-needed" and changed_now):
        return "reboot"
    if policy == "if-bare" and changed_now and loaded is None:  # a node with no driver before: nothing served there
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



@gpufleet_operation()
def refresh_lists(sources_file: str, package: str, changed: Callable[[], bool]) -> Commands:
    """
    Refresh the lists of one repository when its source or key changed, or when apt knows no version of
    ``package`` yet (the lists were never fetched). An installed ``package`` is one apt knows: the node state
    says so without asking apt.

    + sources_file: the repository's ``sources.list`` file
    + package: a package that repository must provide (in the role's ``node.observe`` packages)
    + changed: whether its source or key changed in this run
    """
    if not changed():
        if package in node.packages([package]):
            host.noop(f"{package} is installed; the repository's source and key are unchanged")
            return
        if host.get_fact(AptCandidate, package=package) is not None:
            host.noop(f"apt knows {package}; the repository's source and key are unchanged")
            return
    yield from apt.update._inner(sources_file=sources_file)


def _installed_version(package: str) -> str | None:
    """The version dpkg has installed of ``package`` (read now, after any install of this run)."""
    return node.packages([package]).get(package)


@gpufleet_operation()
def packages_at_driver_version(packages: list[str], driver: str) -> Commands:
    """
    Install packages at exactly the installed driver package's version (read when the operation runs,
    after the driver's own install).

    + packages: packages whose versions must equal the driver's (fabric manager, persistence daemon)
    + driver: the driver package
    """
    version = _installed_version(driver)
    if version is None:
        if state.is_executing:
            yield fail(f"driver package {driver} is not installed; cannot match {' '.join(packages)} to it")
        return  # before the deploy runs: the driver's version is not known yet
    yield from apt.packages._inner(packages=[f"{name}={version}" for name in packages], allow_downgrades=True)


@gpufleet_operation()
def kernel_module_matches(
    driver: str, loaded: LoadedModule, policy: RebootPolicy, driver_install: OperationMeta
) -> Commands:
    """
    Make sure the loaded kernel module is the installed driver's: nothing to do, reboot and probe
    again, or stop the node with "reboot required" (see :func:`reboot_action`).

    + driver: the driver package
    + loaded: what NVML reported when the deploy started (probed again when this deploy installed the driver)
    + policy: ``nvidia_driver_reboot``
    + driver_install: the operation that installs the driver package (did it change the package?)
    """
    installed = _installed_version(driver)
    if installed is None:
        if state.is_executing:
            yield fail(f"driver package {driver} is not installed")
        return
    changed_now = driver_install.did_change() if driver_install.is_complete() else bool(driver_install.will_change)
    if changed_now and state.is_executing and not module_matches(installed, loaded.version):
        loaded = LoadedModule.of(_probe_again())  # the package's install may have loaded its module
    action = reboot_action(installed, loaded.version, policy, changed_now)
    if action == "none":
        host.noop(f"{loaded}, driver package {driver} {installed}")
        return
    if action == "stop":
        yield fail(reboot_required_message(driver, installed, loaded, policy))
        return
    yield from server.reboot._inner()
    after = LoadedModule.of(_probe_again())
    if not module_matches(installed, after.version):
        yield fail(f"reboot did not help: driver package {driver} {installed} installed, {after} after the reboot")




def _probe_again() -> NodeFacts | None:
    """The node's facts probed again (None when the probe fails or its facts do not parse)."""
    try:
        doc = host.get_fact(NvmlGpuFacts)
        return None if doc is None else parse_facts(doc, f"{host.name}: probe after the driver's install")
    except Exception:  # noqa: BLE001 - whatever the probe or its parsing raises, the node's facts are unknown
        return None
