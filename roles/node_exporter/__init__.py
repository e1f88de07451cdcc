"""Role ``node_exporter``: Prometheus node_exporter on every node, under its own user, in a systemd sandbox.

After it, the node has:

- the system user and group ``node_exporter`` (no login, no home);
- ``/var/lib/node_exporter/textfile_collector/`` (root, 0755): every ``*.prom`` file a root job writes there
  is served with the node's metrics (textfile collector);
- node_exporter running and enabled, with the systemd collector on (unit states and services' automatic
  restarts, read from systemd over D-Bus), listening on ``node_exporter_listen_address`` (default: the fleet
  address) port ``node_exporter_port``, reachable from the node itself and the monitoring hosts only
  (``IPAddressAllow=``, :mod:`gpufleet.plan.access`). Where it comes from is ``node_exporter_install``:

  - ``tarball``: ``/usr/local/bin/node_exporter`` (root, 0755) from the release tarball, which the controller
    fetched once and checked against ``node_exporter_tarball_sha256`` before pushing it to
    ``/var/cache/gpufleet/node_exporter/``; gpufleet's own ``/etc/systemd/system/node_exporter.service``;
  - ``package``: Debian's ``prometheus-node-exporter`` (without its recommended extra collectors), from the
    node's apt sources or ``node_exporter_apt_source``; Debian's ``prometheus-node-exporter.service`` with
    the drop-in ``prometheus-node-exporter.service.d/gpufleet.conf``, which sets the user, the flags and
    the sandbox. The drop-in is in place before the package is installed, so the service never runs
    with Debian's defaults (every interface, user prometheus).

  What the other method left (binary, unit, package, drop-in, apt source) is removed.

node_exporter restarts only when its binary, its unit or drop-in (flags included) or its package changed.
Variables: roles/node_exporter/defaults.yml.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pyinfra.api.deploy import deploy
from pyinfra.api.operation import OperationMeta
from pyinfra.context import host
from pyinfra.operations.util import any_changed

from gpufleet import templates
from gpufleet.config.schema import HostConfig
from gpufleet.downloads import DownloadError, fetch_verified
from gpufleet.netaddr import host_port
from gpufleet.node_paths import NODE_EXPORTER_CACHE, TEXTFILE_DIR, unit_path
from gpufleet.node_paths import NODE_EXPORTER_PACKAGE_UNIT as PACKAGE_UNIT
from gpufleet.node_paths import NODE_EXPORTER_UNIT as UNIT
from gpufleet.operations import apt, files, node, server, systemd
from gpufleet.plan import access
from gpufleet.run.context import host_config
from gpufleet.units.escape import exec_arg, unit_value
from gpufleet.values.problems import ConfigError, exit_with

USER = "node_exporter"
# tarball
BINARY = "/usr/local/bin/node_exporter"
UNIT_PATH = unit_path(UNIT)
TARBALL_DIR = NODE_EXPORTER_CACHE
# package
PACKAGE = "prometheus-node-exporter"
PACKAGE_BINARY = "/usr/bin/prometheus-node-exporter"
DROP_IN_DIR = f"{unit_path(PACKAGE_UNIT)}.d"
DROP_IN = f"{DROP_IN_DIR}/gpufleet.conf"
APT_LIST = "/etc/apt/sources.list.d/gpufleet-node-exporter.list"

_SIGNED_BY = re.compile(r"signed-by=(/\S+?)[\s\]]")


# --- what the node gets, as plain data (tested without a node) ---------------------------------------------------

def listen_address(cfg: HostConfig, host_name: str) -> str:
    """``ADDRESS:PORT`` for ``--web.listen-address``: the configured address, else the fleet address."""
    address = cfg.node_exporter_listen_address or cfg.fleet_address or host_name
    return host_port(address, cfg.node_exporter_port)


def exporter_flags(cfg: HostConfig, host_name: str) -> list[str]:
    """node_exporter's command-line flags: where it listens, the systemd collector with each service's automatic
    restarts (``node_systemd_service_restart_total``, for the alert on a unit restarting over and over), and the
    textfile collector."""
    return [
        f"--web.listen-address={listen_address(cfg, host_name)}",
        "--collector.systemd",
        "--collector.systemd.enable-restarts-metrics",
        f"--collector.textfile.directory={TEXTFILE_DIR}",
    ]


def tarball_url(cfg: HostConfig) -> str:
    """``node_exporter_tarball_url`` with ``{version}`` filled in."""
    return cfg.node_exporter_tarball_url.replace("{version}", cfg.node_exporter_version)


def unit_context(cfg: HostConfig, host_name: str, monitoring: Iterable[str] = ()) -> dict[str, Any]:
    """The variables of both templates: our unit (tarball) and the drop-in for Debian's unit (package), every
    value escaped for systemd (a value with a line break raises :class:`~gpufleet.units.escape.UnitValueError`)."""
    package = cfg.node_exporter_install == "package"
    return {
        "unit": PACKAGE_UNIT if package else UNIT,
        "binary": PACKAGE_BINARY if package else BINARY,
        "account": USER,
        "version": unit_value(cfg.node_exporter_version),
        "flags": [exec_arg(flag) for flag in exporter_flags(cfg, host_name)],  # each escaped for ExecStart=
        # reachable from the node itself and the monitoring hosts only (``monitoring``: the group's addresses)
        "ip_access": access.unit_lines(access.exporter_sources(cfg, cfg.fleet_address or host_name, monitoring)),
    }


def template_name(cfg: HostConfig) -> str:
    return "package-override.conf.j2" if cfg.node_exporter_install == "package" else "node_exporter.service.j2"


def render(cfg: HostConfig, host_name: str, monitoring: Iterable[str] = ()) -> str:
    """The unit (tarball) or drop-in (package) text exactly as the deploy writes it."""
    return templates.render(f"node_exporter/{template_name(cfg)}", **unit_context(cfg, host_name, monitoring))


def signed_by(apt_source: str) -> str | None:
    """The keyring path an apt source line names with ``signed-by=``."""
    match = _SIGNED_BY.search(apt_source + " ")
    return match[1] if match else None


_binary_digests: dict[Path, str] = {}


def binary_sha256(tarball: Path) -> str:
    """SHA-256 of ``<dir>/node_exporter`` inside a release tarball (what the installed binary must match)."""
    if tarball not in _binary_digests:
        with tarfile.open(tarball, "r:gz") as tar:
            member = next((m for m in tar if m.isfile() and re.fullmatch(r"[^/]+/node_exporter", m.name)), None)
            handle = tar.extractfile(member) if member is not None else None
            if handle is None:
                raise DownloadError(f"{tarball.name}: expected node_exporter-<version>.<os>-<arch>/node_exporter"
                                    " inside, found no such file")
            _binary_digests[tarball] = hashlib.sha256(handle.read()).hexdigest()
    return _binary_digests[tarball]


# --- the deploy ----------------------------------------------------------------------------------------------------

@deploy("Prometheus node_exporter")
def node_exporter() -> None:
    """Converge node_exporter: its user, textfile directory, binary, unit and running service."""
    cfg = host_config()
    try:  # every address of the unit's allow list must be an IP address
        monitoring = access.deploy_group()
        access.exporter_sources(cfg, cfg.fleet_address or host.name, monitoring)
    except ConfigError as error:
        exit_with(error)
    tarball = None
    if cfg.node_exporter_install == "tarball":
        # Fetched and checked before any operation: a bad digest stops the deploy with nothing changed.
        tarball = fetch_verified(tarball_url(cfg), cfg.node_exporter_tarball_sha256)
    node.observe(
        name="Read node_exporter's account, files, package and units",
        users=[USER], groups=[USER], packages=[PACKAGE], units=[UNIT, PACKAGE_UNIT],
        paths=[str(Path(TEXTFILE_DIR).parent), TEXTFILE_DIR, BINARY, UNIT_PATH, TARBALL_DIR, DROP_IN_DIR, DROP_IN,
               APT_LIST, *([f"{TARBALL_DIR}/{tarball.name}"] if tarball else [])],
        listings=[f"{TARBALL_DIR}/*"],
    )
    server.system_account(name=f"Create the system user and group {USER}, without login or home", user=USER)
    files.directory(name="Create /var/lib/node_exporter", path=str(Path(TEXTFILE_DIR).parent))
    files.directory(name=f"Create the textfile collector directory {TEXTFILE_DIR}", path=TEXTFILE_DIR)
    content = render(cfg, host.name, monitoring)
    if tarball is not None:
        _retire_package()
        changed = _install_from_tarball(cfg, tarball, content)
        service = UNIT
    else:
        _retire_tarball()
        changed = _install_from_package(cfg, content)
        service = PACKAGE_UNIT
    systemd.restart(name=f"Restart {service} because its binary, unit or flags changed", unit=service,
                    _if=any_changed(*changed))
    systemd.service(name=f"Ensure {service} runs and starts at boot", unit=service, running=True, enabled=True)


def _install_from_tarball(cfg: HostConfig, tarball: Path, unit_text: str) -> list[OperationMeta]:
    """Push the checked tarball, install its binary when the node's differs, write our unit."""
    files.directory(name=f"Create {TARBALL_DIR}", path=TARBALL_DIR)
    pushed = f"{TARBALL_DIR}/{tarball.name}"
    files.file(name=f"Push {tarball.name} (sha256 checked on the controller)", src=str(tarball), dest=pushed)
    files.pruned(name=f"Remove superseded tarballs from {TARBALL_DIR}", pattern=f"{TARBALL_DIR}/*", keep=[pushed])
    wanted = binary_sha256(tarball)
    binary = server.script(
        name=f"Install node_exporter {cfg.node_exporter_version} from {tarball.name} to {BINARY}",
        script='set -e; tmp="$(mktemp -d)"; trap \'rm -rf "$tmp"\' EXIT; '
               f'tar -xzf {shlex.quote(pushed)} -C "$tmp" --strip-components=1 --no-same-owner'
               ' --wildcards "*/node_exporter"; '
               f'echo "{wanted}  $tmp/node_exporter" | sha256sum --check --quiet; '
               f'install -o root -g root -m 0755 "$tmp/node_exporter" {BINARY}.new; '
               f"mv -f {BINARY}.new {BINARY}",
        done_file=BINARY, done_sha256=wanted,
    )
    unit = files.file(name=f"Write the unit {UNIT_PATH} (user, flags, sandbox)", dest=UNIT_PATH, content=unit_text)
    systemd.daemon_reload(name="Reload systemd: the node_exporter unit changed", _if=unit.did_change)
    return [binary, unit]


def _install_from_package(cfg: HostConfig, drop_in_text: str) -> list[OperationMeta]:
    """Write the drop-in, then configure the apt source and install Debian's package."""
    files.directory(name=f"Create {DROP_IN_DIR}", path=DROP_IN_DIR)
    drop_in = files.file(name=f"Write the drop-in {DROP_IN} (user, flags, sandbox)", dest=DROP_IN,
                         content=drop_in_text)
    systemd.daemon_reload(name="Reload systemd: the node_exporter drop-in changed", _if=drop_in.did_change)
    source = cfg.node_exporter_apt_source
    if source:
        source_changes = []
        keyring_path = signed_by(source)
        if cfg.node_exporter_apt_keyring and keyring_path:
            source_changes.append(files.file(
                name=f"Copy the keyring of node_exporter's apt source to {keyring_path}",
                src=str(Path(cfg.node_exporter_apt_keyring).expanduser()), dest=keyring_path,
            ))
        source_changes.append(files.file(name=f"Write node_exporter's apt source {APT_LIST}", dest=APT_LIST,
                                         content=source + "\n"))
        apt.update(
            name="Update apt's index of node_exporter's source (that source only)", sources_file=APT_LIST,
            _if=lambda: PACKAGE not in node.packages([PACKAGE]) or any(op.did_change() for op in source_changes),
        )
    else:
        files.absent(name=f"No apt source of node_exporter's own ({APT_LIST})", path=APT_LIST)
    package = apt.packages(name=f"Install {PACKAGE} (without its recommended extra collectors)", packages=[PACKAGE],
                           no_recommends=True, update_first=not source)
    return [drop_in, package]


def _retire_tarball() -> None:
    """Remove what the tarball method installed (the package method is in use)."""
    systemd.service(name=f"Stop and disable {UNIT} (the package method is in use)", unit=UNIT, running=False,
                    enabled=False)
    unit = files.absent(name=f"Remove {UNIT_PATH}", path=UNIT_PATH)
    systemd.daemon_reload(name=f"Reload systemd: {UNIT} is gone", _if=unit.did_change)
    files.absent(name=f"Remove {BINARY}", path=BINARY)
    files.absent(name=f"Remove {TARBALL_DIR}", path=TARBALL_DIR)


def _retire_package() -> None:
    """Remove what the package method installed (the tarball method is in use)."""
    systemd.service(name=f"Stop and disable {PACKAGE_UNIT} (the tarball method is in use)", unit=PACKAGE_UNIT,
                    running=False, enabled=False)
    apt.removed(name=f"Purge {PACKAGE}", packages=[PACKAGE])
    drop_in = files.absent(name=f"Remove {DROP_IN_DIR}", path=DROP_IN_DIR)
    systemd.daemon_reload(name=f"Reload systemd: the {PACKAGE_UNIT} drop-in is gone", _if=drop_in.did_change)
    files.absent(name=f"Remove node_exporter's apt source {APT_LIST}", path=APT_LIST)
