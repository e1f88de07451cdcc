"""The systemd sandbox every unit shares (templates/_sandbox.conf.j2): included by every unit and drop-in, written
nowhere else, and rendered with each unit's own choices (GPU devices, JIT, netlink, node_exporter's host view)."""

from __future__ import annotations

import re

import pytest
from jinja2 import UndefinedError, meta

from gpufleet import templates
from gpufleet.plan.access import unit_lines

SANDBOX = "_sandbox.conf.j2"
# Directives of systemd.exec(5)'s sandboxing and confinement, and resource-control's IP filter: written in
# SANDBOX only, beside every directive SANDBOX itself writes (read from it below).
SANDBOX_DIRECTIVES = {
    "IPAddressDeny", "IPAddressAllow", "ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths", "ExecPaths",
    "NoExecPaths", "TemporaryFileSystem", "BindPaths", "BindReadOnlyPaths", "PrivateNetwork", "NetworkNamespacePath",
    "PrivateIPC", "IPCNamespacePath", "ProcSubset", "MountFlags", "RestrictFileSystems", "RestrictNetworkInterfaces",
    "SystemCallLog", "SocketBindAllow", "SocketBindDeny", "DynamicUser", "SecureBits",
}
_DIRECTIVE = re.compile(r"^\s*([A-Z][A-Za-z]+)=", re.MULTILINE)
_IP_ACCESS_PRINTED = re.compile(r"\{\{-?\s*ip_access\b")


def _source(name: str) -> str:
    return (templates.TEMPLATES_DIR / name).read_text()


def _names() -> list[str]:
    return sorted(p.relative_to(templates.TEMPLATES_DIR).as_posix() for p in templates.TEMPLATES_DIR.rglob("*.j2"))


def _includes(name: str) -> set[str]:
    """Every template ``name`` includes, directly or through another."""
    found: set[str] = set()
    todo = [name]
    while todo:
        direct = meta.find_referenced_templates(templates.ENV.parse(_source(todo.pop())))
        for included in direct:
            assert included is not None, f"{name}: an include whose name is computed"
            if included not in found:
                found.add(included)
                todo.append(included)
    return found


def _sandbox_directives() -> set[str]:
    return SANDBOX_DIRECTIVES | set(_DIRECTIVE.findall(_source(SANDBOX)))


# Drop-ins of gpufleet's own units: the unit they add to includes the sandbox (and they may write none of it).
OWN_UNIT_DROP_INS = {"vllm/ray.conf.j2"}
UNITS = [n for n in _names() if "[Service]" in _source(n) and n not in OWN_UNIT_DROP_INS]  # every unit and drop-in


def test_the_units_are_found() -> None:
    assert set(UNITS) == {"vllm/vllm@.service.j2", "vllm/vllm-watchdog@.service.j2", "ray/ray.service.j2",
                          "dcgm_exporter/dcgm-exporter.service.j2",
                          "node_exporter/node_exporter.service.j2", "node_exporter/package-override.conf.j2",
                          "gpu_watch/gpufleet-gpu-watch.service.j2", "router/haproxy-override.conf.j2",
                          "node_lifecycle/gpufleet-node-watch.service.j2",
                          "node_lifecycle/gpufleet-burn-in.service.j2",
                          "monitoring/override.conf.j2", "monitoring/gpufleet-alert-log.service.j2",
                          "router/gpufleet-router-clients.service.j2", "router/gpufleet-token-ledger.service.j2",
                          "keepalived/keepalived-override.conf.j2", "keepalived/gpufleet-router-health.service.j2",
                          "common/gpufleet-capture@.service.j2"}


@pytest.mark.parametrize("name", UNITS)
def test_every_unit_includes_the_sandbox(name: str) -> None:
    assert SANDBOX in _includes(name)


@pytest.mark.parametrize("name", [n for n in _names() if n != SANDBOX])
def test_no_sandbox_directive_is_written_outside_the_sandbox(name: str) -> None:
    source = _source(name)
    written = set(_DIRECTIVE.findall(source)) & _sandbox_directives()
    assert not written, f"{name} sets {sorted(written)}: pass a parameter to {SANDBOX} instead"
    assert not _IP_ACCESS_PRINTED.search(source), f"{name} prints ip_access: {SANDBOX} does"


# --- what each unit gets ---------------------------------------------------------------------------------------

_NODE_EXPORTER = {"account": "node_exporter", "version": "1.9.1", "binary": "/usr/local/bin/node_exporter",
                  "unit": "node_exporter.service", "flags": ["--collector.systemd"]}
VALUES: dict[str, dict[str, object]] = {
    "vllm/vllm@.service.j2": {"etc": "/etc/gpufleet/vllm", "node_tools": "/opt/gpufleet/node",
                              "gate_policy": "/etc/gpufleet/gpu-health.json", "home": "/var/lib/vllm",
                              "secrets_dir": "/etc/gpufleet/secrets", "stop_timeout_s": 105,
                              "on_failure": "gpufleet-capture@restart-loop-%p-%i.service"},
    "vllm/vllm-watchdog@.service.j2": {"etc": "/etc/gpufleet/vllm", "node_tools": "/opt/gpufleet/node",
                                       "secrets_dir": "/etc/gpufleet/secrets"},
    "ray/ray.service.j2": {"kind": "head", "replica": "pool-0", "env_file": "/etc/gpufleet/ray/pool-0.env",
                           "token_file": "/etc/gpufleet/secrets/pool-0.ray.env", "exec_start": "/opt/ray start",
                           "ray": "/opt/ray"},
    "dcgm_exporter/dcgm-exporter.service.j2": {"port": 9400, "address": "10.0.0.5", "run_as": "dcgm-exporter",
                                               "counters": "/etc/dcgm-exporter/c.csv", "xid_window_ms": 300000,
                                               "hostengine": "nvidia-dcgm.service",
                                               "hostengine_address": "localhost:5555"},
    "node_exporter/node_exporter.service.j2": _NODE_EXPORTER,
    "node_exporter/package-override.conf.j2": _NODE_EXPORTER,
    "gpu_watch/gpufleet-gpu-watch.service.j2": {
        "service": "gpufleet-gpu-watch.service", "timer": "gpufleet-gpu-watch.timer",
        "node_tools": "/opt/gpufleet/node", "marker": "/run/gpufleet/gpu-gate-failed",
        "node_env": "/etc/gpufleet/node.env", "exec_start": "/usr/bin/python3 /opt/gpufleet/node/gpu_watch.py",
        "timeout": 300, "run_dir": "gpufleet"},
    "node_lifecycle/gpufleet-node-watch.service.j2": {
        "service": "gpufleet-node-watch.service", "node_tools": "/opt/gpufleet/node",
        "exec_start": "/usr/bin/python3 /opt/gpufleet/node/node_watch.py watch --config /etc/gpufleet/lifecycle.json",
        "state_dir": "gpufleet/node", "textfile_dir": "-/var/lib/node_exporter/textfile_collector",
        "kernel_log": "/dev/kmsg", "state_file": "/var/lib/gpufleet/node/state.json",
        "burn_in_services": "gpufleet-burn-in-quick.service gpufleet-burn-in-full.service"},
    "node_lifecycle/gpufleet-burn-in.service.j2": {
        "service": "gpufleet-burn-in-full.service", "tier": "full", "node_tools": "/opt/gpufleet/node",
        "verdict": "/var/lib/gpufleet/burn-in/full.json", "timeout_s": 3600, "state_dir": "gpufleet/burn-in",
        "exec_start": "/opt/vllm/0.31.0/bin/python /opt/gpufleet/node/burn_in.py --tier full --floors"
                      " /etc/gpufleet/burn-in.json --out /var/lib/gpufleet/burn-in/full.json",
        "gpu": "compute"},
    "router/haproxy-override.conf.j2": {"open_files": 9216, "restart_after_s": 2.0},
    "router/gpufleet-router-clients.service.j2": {
        "timer": "gpufleet-router-clients.timer", "node_tools": "/opt/gpufleet/node",
        "textfile": "/var/lib/node_exporter/textfile_collector/gpufleet_router_clients.prom",
        "textfile_dir": "-/var/lib/node_exporter/textfile_collector",
        "exec_start": "/usr/bin/python3 -I /opt/gpufleet/node/router_admin.py client-metrics"},
    "router/gpufleet-token-ledger.service.j2": {
        "node_tools": "/opt/gpufleet/node", "listen": "127.0.0.1:8407", "peer_listen": "10.0.0.5:8407",
        "budgets": "/etc/gpufleet/token-budgets.json", "tool_sha256": "0" * 64, "state_dir": "gpufleet-token-ledger",
        "exec_start": "/usr/bin/python3 -I /opt/gpufleet/node/token_ledger.py --listen 127.0.0.1:8407"},
    "monitoring/override.conf.j2": {"unit": "prometheus.service", "environment_file": "/etc/default/prometheus",
                                    "config": "/etc/prometheus/gpufleet/prometheus.yml",
                                    "exec_start": "/usr/bin/prometheus", "state_directory": "prometheus/metrics2"},
    "monitoring/gpufleet-alert-log.service.j2": {"node_tools": "/opt/gpufleet/node",
                                                 "service": "gpufleet-alert-log.service",
                                                 "alertmanager": "prometheus-alertmanager.service",
                                                 "account": "prometheus", "tool_sha256": "0" * 64,
                                                 "exec_start": "/usr/bin/python3 -I /opt/gpufleet/node/alert_log.py"},
    "keepalived/keepalived-override.conf.j2": {"account": "keepalived",
                                               "health_service": "gpufleet-router-health.service",
                                               "exec_start": "/usr/sbin/keepalived --dont-fork --vrrp"},
    "common/gpufleet-capture@.service.j2": {
        "node_tools": "/opt/gpufleet/node", "captures_dir": "/var/lib/gpufleet/diag", "keep": 20, "timeout_s": 120,
        "state_dir": "gpufleet/diag", "exec_start": "/usr/bin/python3 -I /opt/gpufleet/node/diag_collect.py capture"},
    "keepalived/gpufleet-router-health.service.j2": {"account": "gpufleet-router-health",
                                                     "state": "/run/gpufleet-router-health/healthy",
                                                     "exec_start": "/usr/bin/python3 -I router_health.py",
                                                     "run_dir": "gpufleet-router-health"},
}
ALLOWED = unit_lines(["10.0.0.5/32"])


def _lines(name: str, ip_access: str | None = ALLOWED) -> list[str]:
    values = VALUES[name] if ip_access is None else {**VALUES[name], "ip_access": ip_access}
    text = templates.render(name, **values)
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def _sandbox_lines(name: str) -> list[str]:
    return [line for line in _lines(name) if line.split("=", 1)[0] in _sandbox_directives()]


BASE = {"NoNewPrivileges=yes", "CapabilityBoundingSet=", "AmbientCapabilities=", "ProtectSystem=strict",
        "PrivateTmp=yes", "PrivateMounts=yes", "KeyringMode=private", "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes", "ProtectKernelLogs=yes", "ProtectControlGroups=yes", "ProtectHostname=yes",
        "RestrictNamespaces=yes", "RestrictRealtime=yes", "RestrictSUIDSGID=yes", "LockPersonality=yes",
        "RemoveIPC=yes", "SystemCallArchitectures=native", "SystemCallFilter=@system-service",
        "DevicePolicy=closed", "IPAddressDeny=any", "IPAddressAllow=localhost 10.0.0.5/32"}
DENY = "SystemCallFilter=~@privileged @mount @swap @reboot @obsolete @debug @cpu-emulation @clock @module @raw-io"
GPU_COMPUTE = {"UMask=0027", "ProtectHome=yes", "ProtectClock=yes", "ProtectProc=invisible",
               "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK", DENY,
               "DeviceAllow=char-nvidia-frontend rw", "DeviceAllow=char-nvidia-uvm rw",
               "DeviceAllow=char-nvidia-caps rw", "DeviceAllow=char-nvidia-nvswitch rw"}
NODE_EXPORTER = {"UMask=0077", "ProtectHome=read-only", "PrivateUsers=yes", "PrivateDevices=yes",
                 "MemoryDenyWriteExecute=yes", "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
                 f"{DENY} @resources", "SystemCallFilter=adjtimex clock_adjtime", "SystemCallErrorNumber=EPERM"}
EXPECTED = {
    # PyTorch and Ray: CUDA devices, JIT-compiled kernels, their own affinity, NUMA policy and limits
    "vllm/vllm@.service.j2": BASE | GPU_COMPUTE,
    "ray/ray.service.j2": BASE | GPU_COMPUTE,
    # root with no capability, only for systemctl: no device, W^X memory, no @resources (EPERM), no netlink
    "vllm/vllm-watchdog@.service.j2": BASE | {
        "UMask=0077", "ProtectHome=yes", "ProtectClock=yes", "ProtectProc=invisible", "MemoryDenyWriteExecute=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", f"{DENY} @resources", "SystemCallErrorNumber=EPERM",
        "PrivateDevices=yes"},
    # NVML reads, a Go binary: W^X memory, no @resources (EPERM), no netlink
    "dcgm_exporter/dcgm-exporter.service.j2": BASE | {
        "UMask=0077", "ProtectHome=yes", "ProtectClock=yes", "ProtectProc=invisible", "MemoryDenyWriteExecute=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", f"{DENY} @resources", "SystemCallErrorNumber=EPERM",
        "DeviceAllow=char-nvidia-frontend rw", "DeviceAllow=char-nvidia-caps r"},
    # host metrics: no device, /home read-only, /proc whole, the clock's status readable
    "node_exporter/node_exporter.service.j2": BASE | NODE_EXPORTER,
    "node_exporter/package-override.conf.j2": BASE | NODE_EXPORTER,
    # root with no capability, for systemctl; NVML reads (the probe), W^X memory, no @resources (EPERM), no netlink
    "gpu_watch/gpufleet-gpu-watch.service.j2": BASE | {
        "UMask=0077", "ProtectHome=yes", "ProtectClock=yes", "ProtectProc=invisible", "MemoryDenyWriteExecute=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", f"{DENY} @resources", "SystemCallErrorNumber=EPERM",
        "DeviceAllow=char-nvidia-frontend rw", "DeviceAllow=char-nvidia-caps r"},
    # root with CAP_SYSLOG only, for systemctl, the journal and the kernel log (read-only); node_exporter's textfile:
    # no other device, W^X memory, no @resources (EPERM), no netlink
    "node_lifecycle/gpufleet-node-watch.service.j2": (BASE - {"CapabilityBoundingSet=", "ProtectKernelLogs=yes"}) | {
        "CapabilityBoundingSet=CAP_SYSLOG", "DeviceAllow=/dev/kmsg r",
        "ReadWritePaths=-/var/lib/node_exporter/textfile_collector", "UMask=0077", "ProtectHome=yes",
        "ProtectClock=yes", "ProtectProc=invisible", "MemoryDenyWriteExecute=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", f"{DENY} @resources", "SystemCallErrorNumber=EPERM"},
    # root with CAP_SYSLOG only, reading what root's units keep: the journal and the kernel log (read-only), the GPUs
    # through NVML (the probe); it writes its state folder alone: W^X memory, no @resources (EPERM), no netlink
    "common/gpufleet-capture@.service.j2": (BASE - {"CapabilityBoundingSet=", "ProtectKernelLogs=yes"}) | {
        "CapabilityBoundingSet=CAP_SYSLOG", "DeviceAllow=/dev/kmsg r", "UMask=0077",
        "ProtectHome=yes", "ProtectClock=yes", "ProtectProc=invisible", "MemoryDenyWriteExecute=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", f"{DENY} @resources", "SystemCallErrorNumber=EPERM",
        "DeviceAllow=char-nvidia-frontend rw", "DeviceAllow=char-nvidia-caps r"},
    # root with no capability: the burn-in's torch on the GPUs (JIT, its own affinity and limits, NCCL's netlink); its
    # verdict readable by all (0644)
    "node_lifecycle/gpufleet-burn-in.service.j2": BASE | (GPU_COMPUTE - {"UMask=0027"}) | {"UMask=0022"},
    # HAProxy as its own account: no device, no @resources (EPERM: its limits come from the unit), no netlink;
    # Debian's bind mount of /dev/log dropped; memory it may make executable (PCRE2's JIT compiles its regexes)
    "router/haproxy-override.conf.j2": BASE | {
        "UMask=0077", "ProtectHome=yes", "ProtectClock=yes", "ProtectProc=invisible",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", f"{DENY} @resources", "SystemCallErrorNumber=EPERM",
        "PrivateDevices=yes", "BindReadOnlyPaths="},
    # root with no capability, for HAProxy's runtime socket; writes node_exporter's textfile (0644) and nothing
    # else: no device, W^X memory, no @resources (EPERM), no netlink
    "router/gpufleet-router-clients.service.j2": BASE | {
        "UMask=0022", "ProtectHome=yes", "ProtectClock=yes", "ProtectProc=invisible", "MemoryDenyWriteExecute=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", f"{DENY} @resources", "SystemCallErrorNumber=EPERM",
        "PrivateDevices=yes", "ReadWritePaths=-/var/lib/node_exporter/textfile_collector"},
    # root with no capability, the routers' token ledger: writes nothing; no device, W^X memory, no @resources
    # (EPERM), no netlink
    "router/gpufleet-token-ledger.service.j2": BASE | {
        "UMask=0077", "ProtectHome=yes", "ProtectClock=yes", "ProtectProc=invisible", "MemoryDenyWriteExecute=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", f"{DENY} @resources", "SystemCallErrorNumber=EPERM",
        "PrivateDevices=yes"},
    # Prometheus and Alertmanager as their own account (Go binaries): no device, W^X memory, no @resources (EPERM),
    # no netlink, no other user visible
    "monitoring/override.conf.j2": BASE | {
        "UMask=0077", "ProtectHome=yes", "ProtectClock=yes", "ProtectProc=invisible", "MemoryDenyWriteExecute=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", f"{DENY} @resources", "SystemCallErrorNumber=EPERM",
        "PrivateDevices=yes", "PrivateUsers=yes"},
    # keepalived as its own account with VRRP's capabilities only (bounding and ambient): the virtual address and
    # netlink, VRRP's raw socket and the gratuitous ARP's packet socket; no device, W^X memory, no @resources (EPERM)
    "keepalived/keepalived-override.conf.j2": (BASE - {"CapabilityBoundingSet=", "AmbientCapabilities="}) | {
        "CapabilityBoundingSet=CAP_NET_ADMIN CAP_NET_RAW CAP_NET_BROADCAST",
        "AmbientCapabilities=CAP_NET_ADMIN CAP_NET_RAW CAP_NET_BROADCAST",
        "UMask=0077", "ProtectHome=yes", "ProtectClock=yes", "ProtectProc=invisible", "MemoryDenyWriteExecute=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK AF_PACKET", f"{DENY} @resources",
        "SystemCallErrorNumber=EPERM", "PrivateDevices=yes"},
    # the routers' HAProxy check (Python, standard library) as its own account: nothing but its HTTP request
    "keepalived/gpufleet-router-health.service.j2": BASE | {
        "UMask=0077", "ProtectHome=yes", "ProtectClock=yes", "ProtectProc=invisible", "MemoryDenyWriteExecute=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", f"{DENY} @resources", "SystemCallErrorNumber=EPERM",
        "PrivateDevices=yes", "PrivateUsers=yes"},
    # the alert log as Prometheus's account (Python, standard library): the same as Prometheus's
    "monitoring/gpufleet-alert-log.service.j2": BASE | {
        "UMask=0077", "ProtectHome=yes", "ProtectClock=yes", "ProtectProc=invisible", "MemoryDenyWriteExecute=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", f"{DENY} @resources", "SystemCallErrorNumber=EPERM",
        "PrivateDevices=yes", "PrivateUsers=yes"},
}


@pytest.mark.parametrize("name", UNITS)
def test_each_unit_gets_its_sandbox_once(name: str) -> None:
    lines = _sandbox_lines(name)
    assert set(lines) == EXPECTED[name]
    assert len(lines) == len(set(lines)), "a sandbox directive written twice"


@pytest.mark.parametrize("name", UNITS)
def test_syscall_filters_keep_their_order(name: str) -> None:
    """systemd applies SystemCallFilter= lines in order: the allow list, the deny list, then what comes back."""
    filters = [line for line in _lines(name) if line.startswith("SystemCallFilter=")]
    assert filters[:2] == ["SystemCallFilter=@system-service", next(f for f in filters if f.startswith(DENY))]
    assert filters[2:] == (["SystemCallFilter=adjtimex clock_adjtime"] if "node_exporter" in name else [])


@pytest.mark.parametrize("name", UNITS)
def test_without_an_allow_list_there_is_no_ip_filter(name: str) -> None:
    assert not any(line.startswith("IPAddress") for line in _lines(name, ip_access=""))


def test_ip_access_is_required_but_by_vllm() -> None:
    """vLLM serves everyone while it has no allow list (no routers, no vllm_api_allowed_from); every other unit
    must be given its list."""
    assert not any(line.startswith("IPAddress") for line in _lines("vllm/vllm@.service.j2", ip_access=None))
    with pytest.raises(UndefinedError):
        _lines("ray/ray.service.j2", ip_access=None)


@pytest.mark.parametrize("values", [{"gpu": "cuda"}, {"protect_home": "tmpfs"}])
def test_an_unknown_parameter_value_is_an_error(values: dict[str, str]) -> None:
    with pytest.raises(UndefinedError):
        templates.ENV.from_string('{% include "_sandbox.conf.j2" %}').render(ip_access="", **values)


def test_jinja_env_kwargs_is_a_fresh_loader_each_time() -> None:
    """pyinfra's files.template pops the loader out of the dict it is given."""
    first, second = templates.jinja_env_kwargs(), templates.jinja_env_kwargs()
    assert first is not second and first["loader"].searchpath == [str(templates.TEMPLATES_DIR)]
