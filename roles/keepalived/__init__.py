"""Role ``keepalived``: the routers' virtual address (``router_virtual_address``), held by one router at a time.

With a virtual address and two or more hosts in the inventory group ``routers``, after it a router has:

- Debian's ``keepalived`` package; ``keepalived.service`` running and enabled, with the drop-in
  ``/etc/systemd/system/keepalived.service.d/gpufleet.conf``: VRRP only, as the account ``keepalived`` with
  CAP_NET_ADMIN, CAP_NET_RAW and CAP_NET_BROADCAST only, in gpufleet's sandbox, VRRP to and from the other routers
  only (systemd's IP filter), its pid files in ``/run/keepalived``;
- ``/etc/keepalived/keepalived.conf`` (root:keepalived, 0640: it holds the VRRP group's password; written without
  a diff and checked by ``keepalived -t`` before it replaces the one in use): one VRRP 2 instance, every router
  starting as a backup with ``nopreempt``, its priority from the group's order (the first router highest),
  advertisements each second by unicast from the router's own address to the others', the group's password
  (``router_vrrp_password``), the address as ``router_virtual_address/router_virtual_prefix`` on
  ``router_virtual_interface`` (else ``fleet_interface``, else the interface that holds the router's address);
- ``gpufleet-router-health.service``: role common's node tool ``router_health.py`` as the account
  ``gpufleet-router-health``, asking this router's HAProxy ``GET /health`` on its metrics port each second and
  keeping ``/run/gpufleet-router-health/healthy`` at 1 while it passes, 0 while not; keepalived tracks the file
  (a router whose HAProxy fails is in FAULT: it gives the address up at once, and the next router takes it).

HAProxy listens on the address on every router (role router), so the router that takes it serves at once.
A changed configuration reloads keepalived (SIGHUP: the address stays where it is); a changed unit restarts it.
A host that is not a router, or a fleet without a virtual address, has the units stopped and disabled and gpufleet's
files removed, where gpufleet had written them (a keepalived an operator runs without gpufleet's drop-in is left
alone). Variables: roles/keepalived/defaults.yml; the rules across hosts: :mod:`gpufleet.plan.virtual_address`.
"""

from __future__ import annotations

import hashlib
import shlex
from typing import Any

from pyinfra.api.deploy import deploy
from pyinfra.context import host, state
from pyinfra.operations.util import any_changed

from gpufleet import templates
from gpufleet.config.inventory_shape import ROUTERS_GROUP
from gpufleet.config.schema import HostConfig
from gpufleet.facts.network import AddressInterface
from gpufleet.netaddr import host_port
from gpufleet.node_paths import (
    NODE_PYTHON,
    ROUTER_HEALTH_DIR,
    ROUTER_HEALTH_SERVICE,
    ROUTER_HEALTH_STATE,
    node_tool,
    unit_path,
)
from gpufleet.operations import apt, files, node, server, systemd
from gpufleet.operations.server import checked_install  # shell text, not an operation
from gpufleet.plan import access
from gpufleet.plan.virtual_address import PASSWORD_KEY, VirtualAddress, group, password_problem, read_password
from gpufleet.run.context import fleet, host_config
from gpufleet.units.escape import exec_line
from gpufleet.values.problems import ConfigError, Problem, exit_with

PACKAGE = "keepalived"
SERVICE = "keepalived.service"
ACCOUNT = "keepalived"  # keepalived runs as this account, with the capabilities of VRRP only
HEALTH_ACCOUNT = "gpufleet-router-health"  # router_health.py's account: no privilege at all
CONFIG = "/etc/keepalived/keepalived.conf"
CANDIDATE = "/etc/keepalived/gpufleet-candidate.conf"  # checked with keepalived -t before it replaces CONFIG
RUN_DIR = "/run/keepalived"  # the unit's RuntimeDirectory=: keepalived's pid files
DROP_IN_DIR = f"{unit_path(SERVICE)}.d"
DROP_IN = f"{DROP_IN_DIR}/gpufleet.conf"
HEALTH_UNIT = unit_path(ROUTER_HEALTH_SERVICE)
KEEPALIVED = "/usr/sbin/keepalived"


# --- what a router gets, as plain data (tested without a node) --------------------------------------------------

def exec_argv(config: str = CONFIG, run_dir: str = RUN_DIR) -> list[str]:
    """keepalived's command line: VRRP only, in the foreground, logging to its stderr, its pid files in RUN_DIR."""
    return [KEEPALIVED, "--dont-fork", "--vrrp", "--log-console", "--no-syslog", f"--use-file={config}",
            f"--pid={run_dir}/keepalived.pid", f"--vrrp_pid={run_dir}/vrrp.pid"]


def config_values(vip: VirtualAddress, router: str, interface: str, password: str,
                  health_state: str = ROUTER_HEALTH_STATE) -> dict[str, Any]:
    """What templates/keepalived/keepalived.conf.j2 is rendered with, for ``router`` of the group ``vip``; every
    value validated (addresses, an interface name, the password's characters)."""
    if problem := password_problem(password):
        raise ConfigError([Problem("controller", PASSWORD_KEY, problem)])
    return {"own_address": vip.own_address(router), "peers": vip.peers(router), "priority": vip.priority(router),
            "router_id": vip.router_id, "interface": interface, "address": vip.address, "prefix": vip.prefix,
            "password": password, "health_state": health_state}


def render_config(values: dict[str, Any]) -> str:
    """keepalived.conf exactly as the deploy writes it."""
    return templates.render("keepalived/keepalived.conf.j2", **values)


def drop_in(vip: VirtualAddress, router: str) -> str:
    """keepalived.service's drop-in: the account, the command line, the sandbox, VRRP from and to the routers."""
    allowed = access.allow_list([vip.own_address(router)], vip.peers(router))
    return templates.render("keepalived/keepalived-override.conf.j2", account=ACCOUNT,
                            health_service=ROUTER_HEALTH_SERVICE, exec_start=exec_line(exec_argv()),
                            ip_access=access.unit_lines(allowed))


def health_argv(cfg: HostConfig, address: str) -> list[str]:
    """router_health.py's command line: HAProxy's /health on this router's metrics port, into the state file."""
    return [NODE_PYTHON, "-I", node_tool("router_health.py"), "--url",
            f"http://{host_port(address, cfg.router_metrics_port)}/health", "--state", ROUTER_HEALTH_STATE]


def health_unit(cfg: HostConfig, address: str) -> str:
    """gpufleet-router-health.service: the check, as its own account, reaching this router's address only."""
    return templates.render("keepalived/gpufleet-router-health.service.j2", account=HEALTH_ACCOUNT,
                            state=ROUTER_HEALTH_STATE, exec_start=exec_line(health_argv(cfg, address)),
                            run_dir=ROUTER_HEALTH_DIR.removeprefix("/run/"),
                            ip_access=access.unit_lines(access.allow_list([address])))


# --- the deploy ----------------------------------------------------------------------------------------------------

def fleet_group() -> VirtualAddress | None:
    """The running deploy's VRRP group (validated with the inventory); None without a virtual address."""
    try:
        routers = [member.name for member in state.inventory.get_group(ROUTERS_GROUP)]
    except Exception:  # noqa: BLE001 - pyinfra raises NoGroupError for a group the inventory does not define
        return None
    return group(routers, fleet().configs)


def interface(cfg: HostConfig, address: str) -> str:
    """Where the address goes on this router: router_virtual_interface, fleet_interface, else the interface that
    holds the router's own address (read from the node); exits 2 when none does."""
    chosen = cfg.router_virtual_interface or cfg.fleet_interface or host.get_fact(AddressInterface, address=address)
    if chosen is None:
        exit_with(ConfigError([Problem(host.name, "router_virtual_interface", f"expected an interface that holds"
                                                  f" the router's address {address}, found none on the router;"
                                                  " set router_virtual_interface")]))
    return str(chosen)


@deploy("Virtual address (keepalived)")
def keepalived() -> None:
    """Converge keepalived and the HAProxy check on a router of a fleet with a virtual address; retire them
    elsewhere."""
    vip = fleet_group()
    node.observe(name="Read keepalived's package, units and configuration", packages=[PACKAGE],
                 units=[SERVICE, ROUTER_HEALTH_SERVICE], users=[ACCOUNT, HEALTH_ACCOUNT],
                 paths=[CONFIG, CANDIDATE, DROP_IN_DIR, DROP_IN, HEALTH_UNIT])
    if vip is None or host.name not in dict(vip.routers):
        _retire()
        return
    cfg = host_config()
    address = vip.own_address(host.name)
    try:
        text = render_config(config_values(vip, host.name, interface(cfg, address),
                                                 read_password(cfg.router_vrrp_password)))
    except ConfigError as error:
        exit_with(error)
    wanted = hashlib.sha256(text.encode()).hexdigest()
    apt.packages(name="Install keepalived (the distribution's package)", packages=[PACKAGE], update_first=True)
    server.system_account(name=f"Create the account {ACCOUNT} (keepalived)", user=ACCOUNT)
    server.system_account(name=f"Create the account {HEALTH_ACCOUNT} (the HAProxy check)", user=HEALTH_ACCOUNT)
    health = files.file(name=f"Write {HEALTH_UNIT} (HAProxy's health for keepalived)", dest=HEALTH_UNIT,
                        content=health_unit(cfg, address))
    files.directory(name=f"Create {DROP_IN_DIR}", path=DROP_IN_DIR)
    unit = files.file(name=f"Write the drop-in {DROP_IN} (account, capabilities, sandbox)", dest=DROP_IN,
                      content=drop_in(vip, host.name))
    systemd.daemon_reload(name="Reload systemd: keepalived's units changed", _if=any_changed(health, unit))
    systemd.restart(name=f"Restart {ROUTER_HEALTH_SERVICE}: its unit changed", unit=ROUTER_HEALTH_SERVICE,
                    _if=health.did_change)
    systemd.service(name=f"Ensure {ROUTER_HEALTH_SERVICE} runs and starts at boot", unit=ROUTER_HEALTH_SERVICE,
                    running=True, enabled=True)
    files.secret_file(name=f"Write keepalived's configuration to check ({CANDIDATE}, holds the VRRP password)",
                      dest=CANDIDATE, content=text, mode="0640", group=ACCOUNT)
    config = server.script(
        name=f"Check the configuration with keepalived -t, then put it in place ({CONFIG})",
        script=checked_install(f"{KEEPALIVED} -t -f {shlex.quote(CANDIDATE)}", CANDIDATE, CONFIG, ACCOUNT),
        done_file=CONFIG, done_sha256=wanted,
    )
    systemd.restart(name=f"Restart {SERVICE}: its drop-in changed", unit=SERVICE, _if=unit.did_change)
    systemd.reload(name=f"Reload {SERVICE}: its configuration changed (the address stays where it is)",
                   unit=SERVICE, _if=any_changed(config))
    systemd.service(name=f"Ensure {SERVICE} runs and starts at boot", unit=SERVICE, running=True, enabled=True)


def _retire() -> None:
    """Stop and disable keepalived and the check where gpufleet set them up (its drop-in is there); remove
    gpufleet's files, the password's first."""

    def ours() -> bool:
        return node.path(DROP_IN)["type"] != "missing"

    systemd.service(name=f"Stop and disable {SERVICE} (no virtual address on this host)", unit=SERVICE,
                    running=False, enabled=False, _if=ours)
    systemd.service(name=f"Stop and disable {ROUTER_HEALTH_SERVICE} (no virtual address on this host)",
                    unit=ROUTER_HEALTH_SERVICE, running=False, enabled=False, _if=ours)
    files.absent(name=f"Remove {CONFIG} (it held the VRRP password)", path=CONFIG, _if=ours)
    files.absent(name=f"Remove {CANDIDATE}", path=CANDIDATE, _if=ours)
    health = files.absent(name=f"Remove {HEALTH_UNIT}", path=HEALTH_UNIT, _if=ours)
    unit = files.absent(name=f"Remove {DROP_IN} (last: it marks keepalived as gpufleet's)", path=DROP_IN)
    systemd.daemon_reload(name="Reload systemd: keepalived's units are gone", _if=any_changed(health, unit))
