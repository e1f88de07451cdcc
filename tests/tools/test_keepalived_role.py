"""Role keepalived with Debian's keepalived (2.2.7) and systemd on this machine.

- keepalived's configuration test (``keepalived -t``) accepts what the role renders, and refuses it broken;
- Debian's keepalived.service with the role's drop-in, and the HAProxy check's unit, pass ``systemd-analyze verify``
  and rate within gpufleet's exposure bound (``systemd-analyze security --offline``);
- two routers in network namespaces this test makes (a switch, two routers, a client; nothing of this machine's own
  network is touched): each runs HAProxy from the router role's configuration, router_health.py and keepalived from
  the keepalived role's, each as an account without privilege (keepalived with the network capabilities only, and
  /proc/sys read-only as ProtectKernelTunables= makes it), at nice 0 as their units run them, whatever the test runs
  at. The address moves when the holder's HAProxy dies, stays where it is when that HAProxy is back (nopreempt), and
  moves again when the holder drops off the network; the client reaches HAProxy on the address after each move.
  Every process and namespace goes at the end.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import roles.keepalived as role
import roles.router as router_role
from gpufleet import node_paths
from gpufleet.plan.virtual_address import VirtualAddress
from gpufleet.units.security import EXPOSURE_BOUND, exposure
from tests.conftest import ROOT, host_tool, skip_or_fail
from tests.polling import until
from tests.tools.systemd_verify import stub_root, verify_unit
from tests.unit.configs import host_config
from tests.unit.unit_files import Unit

DEBIAN_UNIT = Path("/lib/systemd/system/keepalived.service")
PASSWORD = "s3cret-8"
MOVE_BOUND_S = 5.0  # the bound: the address moves within 5 s


def _keepalived() -> str:
    keepalived = host_tool("keepalived", "keepalived")
    assert DEBIAN_UNIT.is_file(), "Debian's keepalived package is needed (scripts/install-lab-deps.sh)"
    return keepalived


def _group(*addresses: str, vip: str = "192.0.2.100") -> VirtualAddress:
    return VirtualAddress(vip, 24, 51, tuple((f"r{i + 1}", address) for i, address in enumerate(addresses)))


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    assert not check or done.returncode == 0, f"{argv}: {done.stdout}{done.stderr}"
    return done


def _root_with_netns() -> None:
    if os.geteuid() != 0:
        skip_or_fail("network namespaces need root")
    host_tool("ip", "iproute2")


# --- keepalived -t ----------------------------------------------------------------------------------------------

@pytest.fixture
def namespace() -> Iterator[str]:
    """A network namespace holding an interface bond0 (one end of a veth pair), for keepalived's configuration
    test."""
    _root_with_netns()
    name = f"gpfk{os.getpid()}"
    _run("ip", "netns", "add", name)
    try:
        _run("ip", "-n", name, "link", "add", "bond0", "type", "veth", "peer", "name", "bond0p")
        yield name
    finally:
        _run("ip", "netns", "del", name, check=False)


@pytest.mark.parametrize("router", ["r1", "r2"])
def test_keepalived_accepts_the_rendered_configuration(namespace: str, router: str, tmp_path: Path) -> None:
    keepalived = _keepalived()
    text = role.render_config(role.config_values(_group("192.0.2.11", "192.0.2.12"), router, "bond0", PASSWORD))
    (tmp_path / "good.conf").write_text(text)
    (tmp_path / "broken.conf").write_text(text.replace("virtual_router_id 51", "virtual_router_id 51 {"))
    (tmp_path / "elsewhere.conf").write_text(text.replace("bond0", "eth9"))
    good = _run("ip", "netns", "exec", namespace, keepalived, "-t", "-f", str(tmp_path / "good.conf"), check=False)
    assert good.returncode == 0, good.stdout + good.stderr
    assert not re.search(r"WARNING|deprecated", good.stderr) and PASSWORD not in good.stdout + good.stderr
    for bad in ("broken.conf", "elsewhere.conf"):  # the test can fail: a broken file, an interface not there
        refused = _run("ip", "netns", "exec", namespace, keepalived, "-t", "-f", str(tmp_path / bad), check=False)
        assert refused.returncode != 0, bad


# --- systemd -----------------------------------------------------------------------------------------------------

def _units() -> tuple[Unit, Unit]:
    cfg = host_config(router_metrics_port=8405)
    health = Unit(node_paths.ROUTER_HEALTH_SERVICE, role.health_unit(cfg, "10.0.0.5"), [node_paths.NODE_PYTHON])
    drop_in = Unit(role.DROP_IN.removeprefix(node_paths.SYSTEMD_DIR + "/"), role.drop_in(
        _group("10.0.0.5", "10.0.0.6", vip="10.0.0.100"), "r1"), [role.KEEPALIVED, "/bin/kill"],
        drop_in_for=role.SERVICE, extra={role.SERVICE: DEBIAN_UNIT.read_text()})
    return health, drop_in


def test_the_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    _keepalived()
    host_tool("systemd-analyze", "systemd")
    health, drop_in = _units()
    stub_root(tmp_path, [health, drop_in])
    verify_unit(tmp_path, role.SERVICE)
    verify_unit(tmp_path, node_paths.ROUTER_HEALTH_SERVICE)


def test_the_units_are_within_the_exposure_bound(tmp_path: Path) -> None:
    _keepalived()
    systemd_analyze = host_tool("systemd-analyze", "systemd")
    health, drop_in = _units()
    for unit in (health, drop_in):
        path = tmp_path / "etc" / "systemd" / "system" / unit.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(unit.text)
    (tmp_path / "lib" / "systemd" / "system").mkdir(parents=True)
    shutil.copy(DEBIAN_UNIT, tmp_path / "lib" / "systemd" / "system" / role.SERVICE)
    (tmp_path / "etc" / "passwd").write_text("".join(f"{name}:x:{990 + i}:{990 + i}::/nonexistent:/usr/sbin/nologin\n"
                                                     for i, name in enumerate((role.ACCOUNT, role.HEALTH_ACCOUNT))))
    rated = {}
    for name in (role.SERVICE, node_paths.ROUTER_HEALTH_SERVICE):
        done = _run(systemd_analyze, "security", "--offline=yes", f"--root={tmp_path}", "--no-pager", name,
                    check=False)
        rated[name] = exposure(done.stdout).score
    print(rated)
    assert all(score <= EXPOSURE_BOUND for score in rated.values()), rated


# --- the address moves -----------------------------------------------------------------------------------------

SUBNET = "192.0.2"
VIP = f"{SUBNET}.100"
CLIENT = f"{SUBNET}.99"
CAPS = "net_admin,net_raw,net_broadcast"


@dataclass
class Router:
    name: str  # r1, r2
    netns: str
    address: str
    dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)


@dataclass
class Lab:
    switch: str
    client: str
    routers: list[Router]
    dir: Path
    unprivileged: str

    def holders(self) -> list[str]:
        """The routers whose interface holds the virtual address now."""
        found = []
        for router in self.routers:
            shown = _run("ip", "-n", router.netns, "-4", "-o", "addr", "show", "dev", "eth0").stdout
            if f" {VIP}/24 " in shown:
                found.append(router.name)
        return found

    def router(self, name: str) -> Router:
        return next(r for r in self.routers if r.name == name)

    def client_health(self) -> int:
        """HTTP status of GET /health on the virtual address, from the client's namespace (0: no answer)."""
        script = (f"import urllib.request\ntry:\n with urllib.request.urlopen('http://{VIP}:8080/health', timeout=2)"
                  " as r: print(r.status)\nexcept Exception: print(0)")
        done = _run("ip", "netns", "exec", self.client, sys.executable, "-I", "-c", script, check=False)
        return int(done.stdout.strip() or 0)

    def start(self, router: Router, what: str) -> None:
        as_user = ["setpriv", "--reuid", self.unprivileged, "--regid", str(pwd.getpwnam(self.unprivileged).pw_gid),
                   "--clear-groups",
                   "--no-new-privs"]
        if what == "haproxy":
            argv = [*as_user, "--bounding-set=-all", "--inh-caps=-all",
                    host_tool("haproxy", "haproxy"), "-db", "-f", str(router.dir / "haproxy.cfg")]
        elif what == "health":
            argv = [*as_user, "--bounding-set=-all", "--inh-caps=-all", sys.executable, "-I",
                    str(ROOT / "gpufleet" / "node" / "router_health.py"), "--url",
                    f"http://{router.address}:8405/health", "--state", str(router.dir / "healthy")]
        else:
            keepalived = role.exec_argv(str(router.dir / "keepalived.conf"), str(router.dir))
            tunables_read_only = "mount --bind /proc/sys /proc/sys && mount -o remount,bind,ro /proc/sys && exec \"$@\""
            argv = ["unshare", "--mount", "sh", "-c", tunables_read_only, "sh", *as_user,
                    f"--bounding-set=-all,+{CAPS.replace(',', ',+')}", f"--inh-caps=-all,+{CAPS.replace(',', ',+')}",
                    f"--ambient-caps=+{CAPS.replace(',', ',+')}", *keepalived]
        log = (router.dir / f"{what}.log").open("ab")
        router.procs[what] = subprocess.Popen(["ip", "netns", "exec", router.netns, *argv], stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self, router: Router, what: str) -> None:
        proc = router.procs.pop(what)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _logs(lab: Lab) -> str:
    return "\n".join(f"--- {log}\n{log.read_text(errors='replace')[-3000:]}"
                     for router in lab.routers for log in sorted(router.dir.glob("*.log")))


# A router's units set no Nice=; the tools tier runs beside the lab at low priority (scripts/run_tiers.py: nice 10,
# and a lower share for its session where the kernel groups sessions). Where the kernel does not, what the test started
# inherited the tier's nice and got about 1% of a core beside the lab's busy processes: router_health.py took 14 s and
# more to start and pass twice, while keepalived waited on its file in FAULT (its own part, 3 s from BACKUP to MASTER,
# did not move), and the test's polling lagged behind; r1 held the address after 5 to 30 s (once not within 20 s), at
# nice 0 after 4 to 6 s.
LAB_NICE = 0


@contextmanager
def _lab() -> Iterator[Lab]:
    """A switch, two routers and a client in network namespaces of their own, every process stopped at the end;
    this process, and what it starts, at LAB_NICE until then."""
    _root_with_netns()
    _keepalived()
    host_tool("haproxy", "haproxy")
    host_tool("setpriv", "util-linux")
    unprivileged = "nobody"
    pwd.getpwnam(unprivileged)
    tag = f"gpfv{os.getpid() % 100000}"
    # a directory the unprivileged account can reach (pytest's is root's own), with nothing else in it
    base = Path(tempfile.mkdtemp(prefix="gpufleet-vip-", dir="/run"))
    base.chmod(0o755)
    names = {"switch": f"{tag}s", "client": f"{tag}c", "r1": f"{tag}a", "r2": f"{tag}b"}
    made: list[str] = []
    lab = Lab(names["switch"], names["client"], [], base, unprivileged)
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, LAB_NICE)  # root may lower it
    try:
        for name in names.values():
            _run("ip", "netns", "add", name)
            made.append(name)
        _run("ip", "-n", lab.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", lab.switch, "link", "set", "br0", "up")
        for port, (ns, address) in enumerate(((names["r1"], f"{SUBNET}.11"), (names["r2"], f"{SUBNET}.12"),
                                              (lab.client, CLIENT)), start=1):
            _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{port}", "netns",
                 lab.switch)
            _run("ip", "-n", lab.switch, "link", "set", f"p{port}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        group = _group(f"{SUBNET}.11", f"{SUBNET}.12", vip=VIP)
        for name, address in group.routers:
            router = Router(name, names[name], address, base / name)
            router.dir.mkdir()
            shutil.chown(router.dir, unprivileged, pwd.getpwnam(unprivileged).pw_gid)
            cfg = host_config(fleet_address=address, router_virtual_address=VIP, router_port=8080,
                              router_metrics_port=8405)
            values = router_role.config_values(cfg, address, [], [], [f"{address}/32"], {})  # the check: itself
            values["admin_socket"] = str(router.dir / "admin.sock")
            (router.dir / "haproxy.cfg").write_text(router_role.render(values))
            conf = router.dir / "keepalived.conf"
            conf.write_text(role.render_config(role.config_values(group, name, "eth0", PASSWORD,
                                                                  str(router.dir / "healthy"))))
            shutil.chown(conf, "root", pwd.getpwnam(unprivileged).pw_gid)
            conf.chmod(0o640)  # as the role writes it: root, readable by keepalived's group
            lab.routers.append(router)
        yield lab
    finally:
        for router in lab.routers:
            for what in list(router.procs):
                try:
                    lab.kill(router, what)
                except ProcessLookupError:
                    router.procs.pop(what, None)
        for name in made:
            _run("ip", "netns", "del", name, check=False)
        shutil.rmtree(base, ignore_errors=True)
        os.setpriority(os.PRIO_PROCESS, 0, niceness)


@pytest.fixture
def lab() -> Iterator[Lab]:
    with _lab() as made:
        yield made


def test_the_routers_processes_run_at_nice_0_whatever_the_tier_runs_at() -> None:
    _root_with_netns()  # root: it may give this process its nice back
    tier = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, max(tier, 10))  # as scripts/run_tiers.py runs the tools tier
    try:
        with _lab() as lab:
            r1 = lab.routers[0]
            lab.start(r1, "haproxy")
            assert os.getpriority(os.PRIO_PROCESS, 0) == LAB_NICE  # the polling too
            assert os.getpriority(os.PRIO_PROCESS, r1.procs["haproxy"].pid) == LAB_NICE
        assert os.getpriority(os.PRIO_PROCESS, 0) == max(tier, 10)  # given back
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, tier)


def test_the_address_moves_to_the_router_whose_haproxy_serves(lab: Lab) -> None:
    r1, r2 = lab.routers
    for what in ("haproxy", "health", "keepalived"):
        lab.start(r1, what)
    try:
        held = until(lambda: lab.holders() == ["r1"], "r1, started first, holds the address", 20)
        print(f"r1, started first, holds the address after {held:.2f} s")
        for what in ("haproxy", "health", "keepalived"):
            lab.start(r2, what)
        until(lambda: (r2.dir / "healthy").exists() and (r2.dir / "healthy").read_text() == "1\n",
              "r2's HAProxy (bound to the address it does not hold) passes", 10)
        time.sleep(3)  # r2 hears r1's advertisements and stays a backup
        assert lab.holders() == ["r1"] and lab.client_health() == 200

        lab.kill(r1, "haproxy")  # kill -9: r1's check is refused at once, r1 gives the address up
        moved = until(lambda: lab.holders() == ["r2"], "the address on r2 alone", MOVE_BOUND_S)
        assert lab.client_health() == 200
        print(f"HAProxy killed on the holder: the address moved in {moved:.2f} s")

        lab.start(r1, "haproxy")  # back: r1 passes again, and does not take the address back (nopreempt)
        until(lambda: (r1.dir / "healthy").read_text() == "1\n", "r1's HAProxy passes again", 10)
        time.sleep(3)
        assert lab.holders() == ["r2"]

        _run("ip", "-n", lab.switch, "link", "set", "p2", "down")  # r2 drops off the network (as powered off)
        moved = until(lambda: "r1" in lab.holders(), "r1 takes the address", MOVE_BOUND_S)
        assert lab.client_health() == 200  # r1's gratuitous ARP told the client where the address is now
        print(f"the holder off the network: the address moved in {moved:.2f} s")
    except BaseException:
        print(_logs(lab))
        raise
    assert PASSWORD not in _logs(lab)
