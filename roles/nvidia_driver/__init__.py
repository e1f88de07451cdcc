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
- with ``cuda_toolkit`` only, NVIDIA's CUDA toolkit ``cuda-toolkit-<major>-<minor>`` of ``cuda_version`` from the
  same repository, in ``/usr/local/cuda-<major>.<minor>`` (vLLM's processes get its ``CUDA_HOME`` and ``PATH``:
  :func:`roles.vllm.replica_files.process_env`), installed after the driver's services;
- a kernel module that matches the driver package: when the version NVML reports (the loaded module)
  differs from the installed package, ``nvidia_driver_reboot`` decides (see :func:`reboot_action`):
  reboot and probe again, or stop the node with ``reboot required: ...``. A stopped node runs no later
  operation of the deploy, so it never serves on a mismatched driver. After this deploy installed the
  package, NVML is asked again first (the install may have loaded the module).

When any of these changed the node, the GPU health gate after this role judges it on a fresh probe, so a node
without a driver converges in one deploy (planned from its declared ``gpu_profile`` until NVML answers).

Variables (roles/nvidia_driver/defaults.yml): ``nvidia_driver_branch``, ``nvidia_driver_kernel_modules``,
``nvidia_driver_version``, ``nvidia_driver_reboot``, ``nvidia_repo_url``, ``nvidia_repo_keyring_url``,
``nvidia_repo_key_fingerprint``, ``cuda_version``, ``cuda_toolkit``; ``gpu_profile`` and ``allow_plain_http``
(roles/fleet).

apt work is idempotent: the package index is refreshed (for this repository only) when the source or
the key changed or when apt does not know the driver package (or the toolkit) yet, packages are installed without
``latest``, and services restart only when their package changed.
"""


from __future__ import annotations

from pyinfra.api.deploy import deploy
from pyinfra.operations.util import any_changed

from gpufleet.gpu.profiles import ProfileError, parse_profile
from gpufleet.gpu.report import NodeFacts
from gpufleet.node_paths import FABRICMANAGER, KEYRING_DIR
from gpufleet.operations import apt, files, node, nvidia, systemd
from gpufleet.run.context import driver_changed, host_config, probed_facts
from gpufleet.templates import render

SOURCE_FILE = "/etc/apt/sources.list.d/gpufleet-nvidia.list"
PIN_FILE = "/etc/apt/preferences.d/gpufleet-nvidia-driver"
UNATTENDED_FILE = "/etc/apt/apt.conf.d/51gpufleet-nvidia-driver"
PERSISTENCED = "nvidia-persistenced"


def driver_package(branch: int, kernel_modules: str) -> str:
    """The driver package of a branch and kernel module flavour (``nvidia-driver-580-open``)."""
    return f"nvidia-driver-{branch}-open" if kernel_modules == "open" else f"nvidia-driver-{branch}"


def fabricmanager_package(branch: int) -> str:
    return f"{FABRICMANAGER}-{branch}"


def cuda_toolkit_package(cuda_version: str) -> str:
    """NVIDIA's CUDA toolkit package of a ``MAJOR.MINOR`` release (``cuda-toolkit-13-0`` for 13.0)."""
    return "cuda-toolkit-" + cuda_version.replace(".", "-")


def keyring_path(url: str) -> str:
    """Where the repository's key goes: ``.gpg`` for a binary keyring, ``.asc`` for an armored key."""
    suffix = ".gpg" if url.rstrip("/").endswith(".gpg") else ".asc"
    return f"{KEYRING_DIR}/gpufleet-nvidia{suffix}"


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


@deploy("NVIDIA driver")
def nvidia_driver() -> None:
    """Converge NVIDIA's repository, the pinned driver branch, persistenced, fabric manager, and the kernel module."""
    cfg = host_config()
    facts = probed_facts()
    branch = cfg.nvidia_driver_branch
    driver = driver_package(branch, cfg.nvidia_driver_kernel_modules)
    keyring = keyring_path(cfg.nvidia_repo_keyring_url)
    fabric = has_nvswitch(facts, cfg.gpu_profile)
    services = [PERSISTENCED] + ([FABRICMANAGER] if fabric else [])
    toolkit = cuda_toolkit_package(cfg.cuda_version) if cfg.cuda_toolkit else None
    node.observe(
        name="Read the driver's files, packages and services",
        paths=[KEYRING_DIR, SOURCE_FILE, PIN_FILE, UNATTENDED_FILE],
        packages=[driver, PERSISTENCED] + ([fabricmanager_package(branch)] if fabric else [])
        + ([toolkit] if toolkit else []),
        units=[f"{s}.service" for s in services],
    )
    files.directory(name=f"Create apt's keyring directory {KEYRING_DIR}", path=KEYRING_DIR)
    key = nvidia.repository_key(
        name=f"Fetch the NVIDIA repository's key to {keyring}, checked against its fingerprint",
        url=cfg.nvidia_repo_keyring_url, dest=keyring, fingerprint=cfg.nvidia_repo_key_fingerprint,
    )
    source = files.file(
        name=f"Add NVIDIA's repository, trusted through {keyring} only", dest=SOURCE_FILE,
        content=render("nvidia_driver/gpufleet-nvidia.list.j2", repo_url=cfg.nvidia_repo_url, keyring=keyring),
    )
    files.file(
        name=f"Pin NVIDIA's driver packages to branch {branch}", dest=PIN_FILE,
        content=render("nvidia_driver/gpufleet-nvidia-driver.pref.j2", branch=branch),
    )
    files.file(
        name="Keep unattended-upgrades away from NVIDIA's driver packages", dest=UNATTENDED_FILE,
        content=render("nvidia_driver/51gpufleet-nvidia-driver.conf.j2"),
    )
    nvidia.refresh_lists(
        name="Refresh the package lists of NVIDIA's repository (when its source or key changed, or apt lacks"
             " the driver)",
        sources_file=SOURCE_FILE, package=driver, changed=any_changed(key, source),
    )
    version = cfg.nvidia_driver_version
    installed = apt.packages(
        name=f"Install the driver package {driver}" + (f" {version}" if version else ""),
        packages=[f"{driver}={version}" if version else driver], allow_downgrades=bool(version),
    )
    changed = {PERSISTENCED: nvidia.packages_at_driver_version(
        name=f"Install {PERSISTENCED} at the driver's version", packages=[PERSISTENCED], driver=driver)}
    if fabric:
        changed[FABRICMANAGER] = nvidia.packages_at_driver_version(
            name=f"Install {fabricmanager_package(branch)} at the driver's version (NVSwitch system)",
            packages=[fabricmanager_package(branch)], driver=driver)
    module = nvidia.kernel_module_matches(
        name="Check that the loaded kernel module is the installed driver's",
        driver=driver, loaded=nvidia.LoadedModule.of(facts), policy=cfg.nvidia_driver_reboot,
        driver_install=installed,
    )
    for meta in (installed, *changed.values(), module):
        driver_changed(meta)  # the gate probes the node again after any of these changed it
    for service in services:
        systemd.restart(name=f"Restart {service}: its package changed", unit=f"{service}.service",
                        _if=changed[service].did_change)
        systemd.service(name=f"Enable and start {service}", unit=f"{service}.service", running=True, enabled=True)
    if toolkit:  # nvcc for vLLM's just-in-time kernels
        nvidia.refresh_lists(name=f"Refresh the package lists of NVIDIA's repository (when apt lacks {toolkit})",
                             sources_file=SOURCE_FILE, package=toolkit, changed=lambda: False)
        apt.packages(name=f"Install the CUDA toolkit {toolkit}", packages=[toolkit])
