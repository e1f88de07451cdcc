"""systemd unit files as gpufleet writes them, read back as systemd reads them.

- :data:`UNIT_CASES`: every unit a role renders for a node at a (validated) fleet address, as a :class:`Unit`;
- :func:`unit_settings` and :func:`exec_argv`: a strict reader of systemd's rules (specifiers, then quotes and
  escapes, then ``$`` expansion; anything gpufleet never writes is an error);
- :data:`HOSTILE`: free text that passes validation, to render them with.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import roles.common as common_role
import roles.dcgm_exporter as dcgm_exporter_role
import roles.gpu_watch as gpu_watch_role
import roles.keepalived as keepalived_role
import roles.monitoring as monitoring_role
import roles.node_exporter as node_exporter_role
import roles.node_lifecycle as node_lifecycle_role
import roles.ray as ray_role
import roles.router as router_role
import roles.vllm as vllm_role
from gpufleet import node_paths
from gpufleet.netaddr import host_port
from gpufleet.plan import access
from gpufleet.plan.commands import ray_start_argv
from gpufleet.templates import render
from gpufleet.units import escape as systemd_text
from roles.router import peers as router_peers
from roles.router import token_ledger
from roles.vllm import replica_files as vf
from tests.unit.configs import host_config

UNIT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # systemd's, for a unit that sets none

# Text that passes validation wherever free text is allowed (vllm_env values, secrets, host names).
HOSTILE = [
    "tiny llama $HOME 100%",
    'say "hi" and \'bye\'',
    "back\\slash \\n not a newline\\",
    "${PATH} $$ %i %% %n",
    "`id` $(id) ; rm -rf / #",
    "modèle ✓ 模型",
    " leading and trailing ",
    "",
]


# --- systemd's reading of what we write (strict: what gpufleet never writes is an error) ------------------------

def unit_settings(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) of a unit file: comments dropped, backslash-continued lines joined."""
    found, section, pending = [], "", ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        found.append((section, key.strip(), value.strip()))
    assert not pending, "a continuation at the end of the file"
    return found


def _specifiers(text: str, instance: str) -> str:
    """``text`` with systemd's specifiers replaced: ``%%`` and ``%i`` (``instance``); any other is an error."""
    def one(match: re.Match[str]) -> str:
        if match[1] == "%":
            return "%"
        if match[1] == "i":
            return instance
        raise AssertionError(f"unexpected specifier %{match[1]} in {text!r}")
    return re.sub(r"%(.)", one, text)


def _words(text: str) -> list[str]:
    """systemd's word splitting of a command line: "..." with \\\\ and \\" escapes; bare words without quotes."""
    words, i = [], 0
    while i < len(text):
        if text[i] in " \t":
            i += 1
            continue
        if text[i] == '"':
            word, i = "", i + 1
            while text[i] != '"':
                if text[i] == "\\":
                    assert text[i + 1] in '\\"', f"an escape gpufleet never writes in {text!r}"
                    i += 1
                word += text[i]
                i += 1
            i += 1
            assert i == len(text) or text[i] in " \t", f"a quote inside a word in {text!r}"
        else:
            end = i
            while end < len(text) and text[end] not in " \t":
                end += 1
            word = text[i:end]
            assert not set(word) & set("\"'\\"), f"quote or backslash in a bare word in {text!r}"
            i = end
        words.append(word)
    return words


def _expand(word: str, env: dict[str, str]) -> str:
    """``word`` with ``$$`` and ``${NAME}`` (from ``env``) expanded as systemd does; a bare ``$`` is an error."""
    def one(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        assert match[1], f"a bare $ in {word!r}"
        return env[match[1]]
    return re.sub(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$", one, word)


def exec_argv(line: str, instance: str = "", env: dict[str, str] | None = None) -> list[str]:
    """The argv systemd runs for an ``ExecStart=`` value."""
    return [_expand(word, env or {}) for word in _words(_specifiers(line, instance))]


# --- the units the roles write ----------------------------------------------------------------------------------

@dataclass
class Unit:
    """A unit file as a role writes it: its name on the node, text, what it runs, and the argv systemd must run."""

    name: str
    text: str
    programs: list[str]
    argv: list[str] | None = None  # the ExecStart= argv expected back, literally
    instance: str = ""
    env: dict[str, str] = field(default_factory=dict)
    drop_in_for: str | None = None
    extra: dict[str, str] = field(default_factory=dict)  # units installed beside it (name -> text)


def _render_ne(cfg_values: dict[str, object]) -> tuple[str, list[str]]:
    """node_exporter's unit text and flags, from a config with ``cfg_values``."""
    cfg = host_config(**cfg_values)
    return node_exporter_role.render(cfg, "ignored"), node_exporter_role.exporter_flags(cfg, "ignored")


def _node_exporter_tarball(address: str) -> Unit:
    """node_exporter's own unit (the tarball install)."""
    text, flags = _render_ne({"fleet_address": address})
    return Unit(node_exporter_role.UNIT, text, [node_exporter_role.BINARY], [node_exporter_role.BINARY, *flags])


def _node_exporter_package(address: str) -> Unit:
    """The drop-in over Debian's node_exporter unit (the package install)."""
    text, flags = _render_ne({"fleet_address": address, "node_exporter_install": "package"})
    return Unit(f"{node_exporter_role.PACKAGE_UNIT}.d/gpufleet.conf", text, [node_exporter_role.PACKAGE_BINARY],
                [node_exporter_role.PACKAGE_BINARY, *flags], drop_in_for=node_exporter_role.PACKAGE_UNIT)


def vllm_service_unit(_: str) -> Unit:
    """vllm@.service, run as instance pool-0 (the same at any address)."""
    replica = "pool-0"
    values = vllm_role.unit_values()
    etc = f"{node_paths.VLLM_ETC}/{replica}"
    return Unit("vllm@.service", render("vllm/vllm@.service.j2", **values),
                [f"{etc}/venv/bin/python", f"{etc}/venv/bin/vllm"],
                [f"{etc}/venv/bin/python", node_paths.node_tool("replica_rank.py"), f"{etc}/ranks.json", "--",
                 f"{etc}/venv/bin/vllm", "serve", "/var/lib/gpufleet/models/m $HOME", "--config", f"{etc}/config.yaml"],
                instance=replica, env={"VLLM_MODEL": "/var/lib/gpufleet/models/m $HOME"})


def _vllm_watchdog(address: str) -> Unit:
    """The watchdog of replica pool-0, on a node at ``address``."""
    replica = "pool-0"
    etc = f"{node_paths.VLLM_ETC}/{replica}"
    return Unit(node_paths.WATCHDOG_UNIT_TEMPLATE,
                render("vllm/vllm-watchdog@.service.j2", **vllm_role.watchdog_unit_values(address)),
                [f"{etc}/venv/bin/python"],
                [f"{etc}/venv/bin/python", "-I", node_paths.node_tool("replica_watchdog.py"),
                 node_paths.watchdog_config(replica)], instance=replica)


def _gpu_watch(_: str) -> Unit:
    """The watch's service, and beside it the timer that starts it (verified with it)."""
    values = gpu_watch_role.service_values()
    argv = [node_paths.NODE_PYTHON, node_paths.node_tool("gpu_watch.py"), "--policy", node_paths.GATE_POLICY,
            "--marker", node_paths.GPU_WATCH_MARKER, "--samples", node_paths.GPU_SAMPLES]
    timer = render("gpu_watch/gpufleet-gpu-watch.timer.j2", **gpu_watch_role.timer_values(30))
    return Unit(node_paths.GPU_WATCH_SERVICE, render("gpu_watch/gpufleet-gpu-watch.service.j2", **values),
                [node_paths.NODE_PYTHON], argv, extra={node_paths.GPU_WATCH_TIMER: timer})


def _node_watch(address: str) -> Unit:
    """The node lifecycle's watch, answering the routers' agent checks on a node at ``address``."""
    cfg = host_config()
    values = node_lifecycle_role.service_values(cfg, access.allow_list([address], ["10.0.0.0/24"]))
    argv = [node_paths.NODE_PYTHON, node_paths.node_tool("node_watch.py"), "watch", "--config",
            node_paths.LIFECYCLE_CONFIG]
    return Unit(node_paths.NODE_WATCH_SERVICE, render("node_lifecycle/gpufleet-node-watch.service.j2", **values),
                [node_paths.NODE_PYTHON], argv)


def _burn_in(_: str) -> Unit:
    """The full burn-in's unit (the quick one differs in its tier alone), run with the release's Python."""
    cfg = host_config()
    python = node_paths.venv_bin(cfg.vllm_version, "python")
    verdict = f"{node_paths.BURN_IN_DIR}/full.json"
    argv = [python, node_paths.node_tool("burn_in.py"), "--tier", "full", "--floors", node_paths.BURN_IN_FLOORS,
            "--out", verdict]
    return Unit(node_paths.burn_in_service("full"),
                render("node_lifecycle/gpufleet-burn-in.service.j2", **node_lifecycle_role.burn_in_values(cfg, "full")),
                [python], argv)


def _capture(_: str) -> Unit:
    """A node's capture of itself, the instance its reason (a restart loop's, as a replica unit's OnFailure= names
    it)."""
    argv = [node_paths.NODE_PYTHON, "-I", node_paths.node_tool("diag_collect.py"), "capture", "--reason",
            "restart-loop-vllm-lab_single-0"]
    return Unit(node_paths.CAPTURE_UNIT_TEMPLATE,
                render("common/gpufleet-capture@.service.j2", **common_role.capture_values()),
                [node_paths.NODE_PYTHON], argv, instance="restart-loop-vllm-lab_single-0")


def _router_clients(_: str) -> Unit:
    """The router's clients' counters, and beside it the timer that starts it (verified with it)."""
    argv = [node_paths.NODE_PYTHON, "-I", node_paths.node_tool("router_admin.py"), "client-metrics", "--textfile",
            router_role.CLIENTS_TEXTFILE, "--socket", node_paths.ROUTER_ADMIN_SOCKET,
            "--edge-dir", router_role.EDGE_DIR]
    cfg = host_config()
    timer = render("router/gpufleet-router-clients.timer.j2", **router_role.clients_timer_values())
    return Unit(router_role.CLIENTS_SERVICE,
                render("router/gpufleet-router-clients.service.j2", **router_role.clients_service_values(cfg)),
                [node_paths.NODE_PYTHON], argv, extra={router_role.CLIENTS_TIMER: timer})


def _token_ledger(address: str) -> Unit:
    """The routers' token ledger on the first of two routers, this one at ``address``."""
    configs = {"r1": host_config(fleet_address=address), "r2": host_config(fleet_address="10.0.0.6")}
    values = token_ledger.service_values("r1", ["r1", "r2"], configs)
    argv = [node_paths.NODE_PYTHON, "-I", node_paths.node_tool("token_ledger.py"), "--budgets", token_ledger.BUDGETS,
            "--listen", "127.0.0.1:8407", "--routers", f"{host_port(address, 8407)},10.0.0.6:8407", "--self", "0",
            "--pem", router_peers.PEM, "--state", token_ledger.STATE]
    return Unit(token_ledger.SERVICE, render("router/gpufleet-token-ledger.service.j2", **values),
                [node_paths.NODE_PYTHON, "/bin/kill"], argv)


def _dcgm_exporter(address: str) -> Unit:
    """dcgm-exporter's unit, listening on ``address``."""
    values = dcgm_exporter_role.unit_values(9400, address, ["10.0.0.0/24"], 300)
    listen = f"[{address}]:9400" if ":" in address else f"{address}:9400"
    return Unit(dcgm_exporter_role.SERVICE, render("dcgm_exporter/dcgm-exporter.service.j2", **values),
                ["/usr/bin/dcgm-exporter"], ["/usr/bin/dcgm-exporter", "-f", dcgm_exporter_role.COUNTERS_FILE,
                                             "-a", listen, "-r", dcgm_exporter_role.HOSTENGINE_ADDRESS, "-x", "300000"])


def ray_head_unit(address: str) -> Unit:
    """The Ray head's unit of replica pool-0, on a node at ``address``."""
    replica = "pool-0"
    cfg = host_config(fleet_interface="bond0")
    argv = ray_start_argv(cfg, address, None)
    values: dict[str, object] = {
        "kind": "head", "replica": replica, "env_file": node_paths.ray_env_file(replica),
        "exec_start": systemd_text.exec_line(argv), "ray": f"{vf.venv_dir(cfg)}/bin/ray",
        "token_file": node_paths.ray_token_file(replica), "ip_access": access.unit_lines(["10.0.0.0/24"]),
    }
    return Unit(ray_role.unit_name(replica), render("ray/ray.service.j2", **values),
                [argv[0], f"{vf.venv_dir(cfg)}/bin/ray"], argv)


def _alert_log(_: str) -> Unit:
    """The alert log's unit, on a monitoring host."""
    cfg = host_config(alertmanager_log_port=9097)
    argv = ["/usr/bin/python3", "-I", node_paths.node_tool("alert_log.py"), "--port", "9097"]
    return Unit(node_paths.ALERT_LOG_SERVICE, monitoring_role.alert_log_unit(cfg), ["/usr/bin/python3"], argv)


def _router_health(address: str) -> Unit:
    """The router health check's unit, on a router at ``address``."""
    cfg = host_config(router_metrics_port=8405)
    return Unit(node_paths.ROUTER_HEALTH_SERVICE, keepalived_role.health_unit(cfg, address), [node_paths.NODE_PYTHON],
                keepalived_role.health_argv(cfg, address))


# Each case: a name, and the unit as its role renders it for a node at a (validated) fleet address. The free
# text of the inventory never reaches a unit: addresses are IPs, replica names the planner's, paths gpufleet's.
UNIT_CASES: list[tuple[str, Callable[[str], Unit]]] = [
    ("node_exporter tarball unit", _node_exporter_tarball),
    ("node_exporter package drop-in", _node_exporter_package),
    ("vllm@.service", vllm_service_unit),
    ("vllm-watchdog@.service", _vllm_watchdog),
    ("dcgm-exporter.service", _dcgm_exporter),
    ("gpufleet-gpu-watch.service and its timer", _gpu_watch),
    ("gpufleet-node-watch.service", _node_watch),
    ("gpufleet-burn-in-full.service", _burn_in),
    ("gpufleet-capture@.service", _capture),
    ("gpufleet-router-clients.service and its timer", _router_clients),
    ("gpufleet-token-ledger.service", _token_ledger),
    ("ray unit of a head", ray_head_unit),
    ("gpufleet-alert-log.service", _alert_log),
    ("gpufleet-router-health.service", _router_health),
]
