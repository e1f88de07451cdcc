"""One host's configuration: every role's settings composed into :class:`HostConfig`, the rules that tie values of
several roles together, and the lists of variables derived from the records (:mod:`gpufleet.config.settings`).

A variable is written once, as a field of its role's settings (:mod:`gpufleet.config.settings`): its type, default,
meaning, scope, secrecy, and the vLLM flags and environment it owns. ``roles/<role>/defaults.yml`` and the variables
reference are written from those records (``make docs``); the lists below are derived from them.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any
from urllib.parse import urlsplit

from pydantic import field_validator

from gpufleet.config import env_names
from gpufleet.config.apt_source import apt_source
from gpufleet.config.lora_files import adapter_problems, whole_number
from gpufleet.config.settings import Setting, records
from gpufleet.config.settings.dcgm import DcgmSettings
from gpufleet.config.settings.dcgm_exporter import DcgmExporterSettings
from gpufleet.config.settings.fleet import FleetSettings
from gpufleet.config.settings.gpu_watch import GpuWatchSettings
from gpufleet.config.settings.keepalived import KeepalivedSettings
from gpufleet.config.settings.monitoring import STALL_SCRAPES, MonitoringSettings
from gpufleet.config.settings.node_exporter import NodeExporterSettings
from gpufleet.config.settings.node_lifecycle import NodeLifecycleSettings
from gpufleet.config.settings.nvidia_driver import NvidiaDriverSettings
from gpufleet.config.settings.ray import RaySettings
from gpufleet.config.settings.router import MIN_KEY_CHARS, RouterSettings
from gpufleet.config.settings.vllm import CPU_KV_SPACE, VllmSettings
from gpufleet.gpu.burn_in_floors import HEALTHY
from gpufleet.gpu.profiles import parse_profile
from gpufleet.values import grammar
from gpufleet.values.problems import KeyedError, shown_key
from gpufleet.values.vllm_flags import FlagCatalog, load_catalog

# vllm_extra_args switches gpufleet needs off, and why.
REFUSED_SWITCHES = {
    "--disable-log-stats": "gpufleet's watchdog, readiness check and alerts read vLLM's stats from /metrics",
}

NODE_PATH_SOURCES = frozenset({"vllm_wheelhouse_url", "vllm_requirements_url"})
"""Install sources that may be a URL or an absolute path on the nodes (pip and uv read either)."""

ROUTER_PORTS = ("router_port", "router_metrics_port", "router_peer_port", "router_ledger_port")
"""The ports a router listens on (and router_plain_http_port, when set): a host that routes nothing leaves them free."""

SHOWN_FIELDS = frozenset({"requests_per_s", "concurrent_requests", "priority", "tokens_per_minute", "tokens_per_day",
                          "share"})
"""A client's limits and class: a number found there under a secret tree is shown, and text shorter than any key
that is a class's name mistyped (``priority``) or a number written as text (``10/s``, ``1_000``); other text (a
word: ``hunter2``) may be a password pasted in the wrong place."""

_WORD = re.compile(r"[A-Za-z]{3}")


def shown_in_tree(field: str, value: Any) -> bool:
    """Whether ``value``, found at ``field`` under a secret tree, is shown: it is no key (:data:`SHOWN_FIELDS`)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    word = isinstance(value, str) and len(value) < MIN_KEY_CHARS and (field == "priority" or not _WORD.search(value))
    return (number or word) and field in SHOWN_FIELDS

LORA_FLAGS = ("--max-loras", "--max-lora-rank", "--max-cpu-loras", "--fully-sharded-loras", "--lora-dtype",
              "--lora-modules", "--lora-target-modules", "--max-lora-cls-labels")
"""LoRA's own flags: read by vLLM only with --enable-lora."""

GPUFLEET_ENV = {
    "CUDA_VISIBLE_DEVICES": "the plan's GPU sets", "HOME": "nothing (gpufleet's)",
    "VLLM_CACHE_ROOT": "nothing (gpufleet's, one per release)",
}
"""Environment variables gpufleet sets on vLLM and Ray processes from no variable (each with what sets it)."""


def _secret_key_path(value: Any, depth: int = 0) -> str | None:
    """The path (``.a.b``, ``[0]``) of the first secret-named key inside an option's value: a mapping, a list, or
    text that vLLM reads as JSON (``hf-overrides``, ``speculative-config``…); None when there is none."""
    if isinstance(value, str) and value.lstrip()[:1] in ("{", "["):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if depth > 64:
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and grammar.names_secret(key):
            return f".{shown_key(key)}"
        if (inner := _secret_key_path(item, depth + 1)) is not None:
            return (f"[{key}]" if isinstance(key, int) else f".{shown_key(str(key))}") + inner
    return None


class HostConfig(
    MonitoringSettings, KeepalivedSettings, RouterSettings, NodeExporterSettings, DcgmExporterSettings, DcgmSettings,
    NvidiaDriverSettings, RaySettings, VllmSettings, NodeLifecycleSettings, GpuWatchSettings, FleetSettings,
):
    """One host's merged configuration: role defaults < all.yml < group_vars < host data < --data. Its fields are
    the roles' settings (pydantic takes the last base's first: fleet, gpu_watch, vllm, ... monitoring)."""

    @field_validator("vllm_env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        """Valid names, none that gpufleet sets itself (``OWNED_ENV``), loads code or changes trust
        (:mod:`gpufleet.config.env_names`), none that looks secret."""
        for name in value:
            if problem := grammar.env_name(name):
                raise KeyedError(name, problem)
            if name in OWNED_ENV or name.startswith(("NCCL_SOCKET_", "GLOO_SOCKET_")):
                raise KeyedError(name, f"expected a variable gpufleet does not set, found {name}"
                                       f" (set {OWNED_ENV.get(name, 'fleet_interface')} instead)")
            if problem := env_names.refusal(name):
                raise KeyedError(name, problem)
            if grammar.looks_secret(name):
                raise KeyedError(name, "expected no secret in vllm_env, found a secret-looking name"
                                       " (use a secret reference: vllm_api_key, vllm_hf_token)")
        return value

    def serving_args(self) -> dict[str, Any]:
        """``vllm_extra_args`` as the replicas run with them: with ``enable-lora`` on where the pool declares LoRA
        adapters and leaves it out."""
        if self.vllm_lora_adapters and not any(k.lstrip("-").replace("_", "-") == "enable-lora"
                                                for k in self.vllm_extra_args):
            return {**self.vllm_extra_args, "enable-lora": True}
        return self.vllm_extra_args

    def contradictions(self, api_ports: int | None = None, routes: bool = True) -> list[tuple[tuple[str, ...], str]]:
        """Values that each pass alone but not together: (keys involved, what is wrong).

        ``api_ports``: the replicas the plan puts on this node, when known (else ``api_ports()``); ``routes``:
        whether the host is a router (the routers' ports are checked on routers only).
        """
        found: list[tuple[tuple[str, ...], str]] = []
        multi_node = self.vllm_nodes_per_replica != "auto" and self.vllm_nodes_per_replica > 1
        if multi_node and self.vllm_replicas_per_node not in ("auto", 1):
            found.append((
                ("vllm_replicas_per_node", "vllm_nodes_per_replica"),
                f"expected 1 or auto with vllm_nodes_per_replica {self.vllm_nodes_per_replica},"
                f" found {self.vllm_replicas_per_node}",
            ))
        if multi_node and self.vllm_data_parallel_size > 1:
            found.append((
                ("vllm_data_parallel_size", "vllm_nodes_per_replica"),
                f"expected 1 with vllm_nodes_per_replica {self.vllm_nodes_per_replica}"
                f" (multi-node data parallel is not planned yet), found {self.vllm_data_parallel_size}",
            ))
        if multi_node and self.fleet_interface is None:
            found.append((
                ("fleet_interface",),
                "expected an interface name for multi-node replicas (NCCL_SOCKET_IFNAME), found null",
            ))
        found += self._cpu_kv_space_problems()
        if self.vllm_distributed_backend == "ray" and self.ray_auth_token is None:
            found.append((("ray_auth_token", "vllm_distributed_backend"),
                          "expected ray_auth_token ({env: NAME} or {file: PATH}) with vllm_distributed_backend ray"
                          " (Ray's cluster token), found null"))
        found += self._gate_problems()
        if self.alert_engine_stall_s < STALL_SCRAPES * self.prometheus_scrape_interval_s:
            found.append((("alert_engine_stall_s", "prometheus_scrape_interval_s"),
                          f"expected a window of at least {STALL_SCRAPES} scrapes"
                          f" ({STALL_SCRAPES * self.prometheus_scrape_interval_s} s at a scrape every"
                          f" {self.prometheus_scrape_interval_s} s), found {self.alert_engine_stall_s}"))
        found += self._port_problems(api_ports or self.api_ports(), routes)
        found += self._url_problems()
        found += self._extra_args_problems()
        if self.vllm_lora_adapters and self.vllm_model is not None:
            found += adapter_problems(self.vllm_lora_adapters, self.served_model_name(), self.vllm_model,
                                      self.vllm_version, self.vllm_extra_args)
        return found

    def _cpu_kv_space_problems(self) -> list[tuple[tuple[str, ...], str]]:
        value = self.vllm_env.get(CPU_KV_SPACE)
        if value is not None and self.cpu_kv_space_gib() is None:
            return [((f"vllm_env.{CPU_KV_SPACE}",), f"expected a whole number of GiB >= 1 (vLLM reads it with int()),"
                                                    f" found {grammar.show(value)}")]
        if value is None and self.vllm_platform == "cpu":
            return [((f"vllm_env.{CPU_KV_SPACE}", "vllm_platform"),
                     f"expected vllm_env to set {CPU_KV_SPACE} (the whole GiB of RAM each worker keeps its KV cache"
                     " in, which the planner sizes the cache from) with vllm_platform cpu, found none")]
        return []

    def _gate_problems(self) -> list[tuple[tuple[str, ...], str]]:
        """GPU gate rules the host can never pass: another GPU count or model than its declared ``gpu_profile``, a
        driver branch above the one gpufleet installs (``nvidia_driver_branch``)."""
        found: list[tuple[tuple[str, ...], str]] = []
        policy = self.gpu_health
        branch = self.nvidia_driver_branch
        if policy.min_driver_branch > branch:
            found.append((("gpu_health.min_driver_branch", "nvidia_driver_branch"),
                          "expected gpu_health.min_driver_branch at most nvidia_driver_branch, the branch gpufleet"
                          f" installs (the gate would never pass), found {policy.min_driver_branch} > {branch}"))
        if self.gpu_profile is None:
            return found
        profile = parse_profile(self.gpu_profile)
        if policy.expected_gpu_count is not None and policy.expected_gpu_count != profile.count:
            found.append((("gpu_health.expected_gpu_count", "gpu_profile"),
                          f"expected gpu_health.expected_gpu_count to be {profile.count}, the GPUs of gpu_profile"
                          f" {self.gpu_profile} (the gate would never pass), found {policy.expected_gpu_count}"))
        model = policy.expected_gpu_model
        if model is not None and model.lower() not in profile.gpu.nvml_name.lower():
            found.append((("gpu_health.expected_gpu_model", "gpu_profile"),
                          f"expected gpu_health.expected_gpu_model to be a part of {profile.gpu.nvml_name!r}, the"
                          f" GPU of gpu_profile {self.gpu_profile} (the gate would never pass),"
                          f" found {grammar.show(model)}"))
        healthy = HEALTHY.get(profile.gpu.key)
        for key, floor in sorted(self.burn_in_floors.items()):
            reached = getattr(healthy, key, None) if self.burn_in_device == "cuda" else None
            if reached is not None and floor > reached:
                found.append(((f"burn_in_floors.{key}", "gpu_profile"),
                              f"expected a floor at most {reached:g}, what a healthy {profile.gpu.key} reaches"
                              f" (every node would fail its burn-in), found {floor:g}"))
        return found

    def _port_problems(self, api_ports: int, routes: bool) -> list[tuple[tuple[str, ...], str]]:
        found: list[tuple[tuple[str, ...], str]] = []
        first, last = self.ray_worker_ports
        if first > last:
            found.append((("ray_worker_ports",), f"expected [first, last] with first <= last, found [{first}, {last}]"))
        ranges = {
            "vllm_port": (self.vllm_port, self.vllm_port + api_ports - 1),
            "ray_port": (self.ray_port, self.ray_port + 8),
            "ray_worker_ports": (min(first, last), max(first, last)),
            "vllm_master_port": (self.vllm_master_port,) * 2,
            "vllm_rank_port": (self.vllm_rank_port,) * 2,
            "node_exporter_port": (self.node_exporter_port,) * 2,
            "dcgm_exporter_port": (self.dcgm_exporter_port,) * 2,
            "prometheus_port": (self.prometheus_port,) * 2,
            "alertmanager_port": (self.alertmanager_port,) * 2,
            "alertmanager_log_port": (self.alertmanager_log_port,) * 2,
        }
        if routes:  # nothing listens on the routers' ports elsewhere
            ranges |= {key: (getattr(self, key),) * 2 for key in ROUTER_PORTS}
        if self.node_lifecycle_enabled:
            ranges["node_agent_port"] = (self.node_agent_port,) * 2
            if self.node_fabric_check:
                ranges["node_fabric_port"] = (self.node_fabric_port,) * 2
        if routes and self.router_plain_http_port is not None:
            ranges["router_plain_http_port"] = (self.router_plain_http_port,) * 2
        why = {"vllm_port": f"one API port per replica, {api_ports} on this node",
               "ray_port": "Ray listens on ray_port .. ray_port + 8"}
        for key, (low, high) in ranges.items():
            if high > 65535:
                found.append(((key,), f"expected ports up to 65535 ({why[key]}), found {low}..{high}"))

        def shown(key: str) -> str:
            low, high = ranges[key]
            return f"{key} {low}" if low == high else f"{key} {low}..{high}"

        keys = list(ranges)
        for i, a in enumerate(keys):
            for b in keys[i + 1:]:
                (a_low, a_high), (b_low, b_high) = ranges[a], ranges[b]
                if a_low <= b_high and b_low <= a_high:
                    if a_low == a_high == b_low == b_high:
                        message = f"expected a port of its own, found {a_low} for both {' and '.join(sorted((a, b)))}"
                        found.append(((b, a), message))
                    else:
                        found.append(((a, b), f"expected {shown(a)} clear of {shown(b)}, found an overlap"))
        return found

    def _url_problems(self) -> list[tuple[tuple[str, ...], str]]:
        found: list[tuple[tuple[str, ...], str]] = []
        plain = self.allow_plain_http
        urls = {"vllm_pip_index_url": self.vllm_pip_index_url, "vllm_wheelhouse_url": self.vllm_wheelhouse_url,
                "vllm_requirements_url": self.vllm_requirements_url, "nvidia_repo_url": self.nvidia_repo_url,
                "nvidia_repo_keyring_url": self.nvidia_repo_keyring_url,
                "node_exporter_tarball_url": self.node_exporter_tarball_url}
        for key, value in urls.items():
            hint = grammar.PIP_CREDENTIALS if key.startswith("vllm_") else grammar.NOT_SECRET_URL
            if key in NODE_PATH_SOURCES and value is not None and value.startswith("/"):
                problem = grammar.node_dir(value)  # on the nodes: pip and uv read a --find-links or -r path
            elif key in NODE_PATH_SOURCES and value is not None and "://" not in value:
                problem = f"expected a URL or an absolute path on the nodes, found {grammar.show(value)}"
            else:
                problem = grammar.url(value, plain, credentials_hint=hint) if value is not None else None
            if problem:
                found.append(((key,), problem))
        webhook = self.alertmanager_webhook_url
        if webhook and (problem := grammar.url(webhook, plain, ("https", "http"), grammar.NOT_SECRET_URL)):
            found.append((("alertmanager_webhook_url",), problem))
        elif webhook and not ipaddress.ip_address(self.alertmanager_listen_address).is_loopback:
            host = urlsplit(webhook).hostname or ""
            try:
                ipaddress.ip_address(host)
            except ValueError:
                found.append((("alertmanager_webhook_url",), "expected an IP address as its host while"
                               f" alertmanager_listen_address is {self.alertmanager_listen_address} (Alertmanager's"
                               f" IP filter admits addresses only), found {grammar.show(host)}"))
        source = self.node_exporter_apt_source
        if source is not None and (problem := apt_source(source, plain)):
            found.append((("node_exporter_apt_source",), problem))
        return found

    def _lora_problems(self, catalog: FlagCatalog) -> list[tuple[tuple[str, ...], str]]:
        """LoRA flags that vLLM would ignore (set without ``--enable-lora``) or refuse (fewer CPU slots than GPU
        slots: LoRAConfig's own rule)."""
        args = self.serving_args()
        enabled = catalog.given(args, "--enable-lora")
        given = {flag: found for flag in LORA_FLAGS if catalog.spec(flag) and (found := catalog.given(args, flag))}
        if given and (enabled is None or enabled[1] is not True):
            flag, (key, _) = next(iter(given.items()))
            return [((f"vllm_extra_args.{shown_key(key)}",),
                     f"expected enable-lora: true with {flag} (vLLM reads its LoRA flags only with it), found"
                     f" {'enable-lora: false' if enabled else 'enable-lora left out'}")]
        slots, cpu = given.get("--max-loras"), given.get("--max-cpu-loras")
        spec = catalog.spec("--max-loras")
        gpu_slots = whole_number(slots[1] if slots else spec.default if spec else 1)
        cpu_slots = whole_number(cpu[1]) if cpu else None
        if cpu and cpu_slots is not None and gpu_slots is not None and cpu_slots < gpu_slots:
            return [((f"vllm_extra_args.{shown_key(cpu[0])}",),
                     f"expected at least max-loras ({gpu_slots}) adapters kept in CPU memory (vLLM's LoRAConfig"
                     f" refuses fewer), found {cpu_slots}")]
        return []

    def _extra_args_problems(self) -> list[tuple[tuple[str, ...], str]]:
        found: list[tuple[tuple[str, ...], str]] = []
        catalog = load_catalog(self.vllm_version)
        if self.vllm_quantization is not None:
            for problem in catalog.check_config({"quantization": self.vllm_quantization}):
                found.append((("vllm_quantization",), f"vLLM {self.vllm_version}: {problem.message}"))
        for key, value in self.vllm_extra_args.items():
            where = (f"vllm_extra_args.{shown_key(key)}",)
            base = key.lstrip("-").partition(".")[0]
            spec = catalog.spec("--" + base)
            flag = spec.name if spec else "--" + base.replace("_", "-")
            if key.startswith("-"):
                found.append((where, f"expected a flag name without dashes, found {grammar.show(key)}"))
            elif flag in OWNED_FLAGS:
                owner = OWNED_FLAGS[flag]  # --config: the file gpufleet writes from vllm_extra_args' keys
                found.append((where, f"expected a flag gpufleet does not own, found {flag};"
                                     f" set {owner}{' keys' if owner == 'vllm_extra_args' else ''} instead"))
            elif flag in REFUSED_SWITCHES and value is not False:
                found.append((where, f"expected {flag} left out ({REFUSED_SWITCHES[flag]}),"
                                     f" found {grammar.show(value)}"))
            elif grammar.looks_secret(base):
                found.append((where, "expected no secret in vllm_extra_args (config.yaml is 0644), found a"
                                     " secret-looking flag; use a secret reference"))
            elif nested := _secret_key_path(value):
                found.append(((f"{where[0]}{nested}",), "expected no secret in vllm_extra_args (config.yaml is 0644),"
                                                        " found a secret-named key (value not shown)"))
            else:
                for problem in catalog.check_config({key: value}):
                    message = problem.message.replace("expects ", "expected ", 1).replace(", got ", ", found ", 1)
                    at = (f"{where[0]}.{problem.subkey}",) if problem.subkey else where
                    found.append((at, f"vLLM {self.vllm_version}: {message}"))
        return found or self._lora_problems(catalog)


RECORDS: dict[str, Setting] = records(HostConfig)
"""Every variable's record, in the order of :class:`HostConfig`'s fields."""
SCHEMA_KEYS: frozenset[str] = frozenset(RECORDS)


def keys(**where: Any) -> tuple[str, ...]:
    """The variables whose records have every attribute given (``keys(scope="pool")``), in field order."""
    return tuple(name for name, record in RECORDS.items()
                 if all(getattr(record, attribute) == value for attribute, value in where.items()))


SECRET_KEYS = frozenset(keys(secret="reference") + keys(secret="env_file"))
"""Variables whose values are secret references; a value found there is never shown."""
SECRET_TREES = frozenset(keys(secret="tree"))
"""Variables that hold secret references among other values: no value under them is ever shown (a client written
``name: <key>``, a key under ``token:``, a list of keys), but what :data:`SHOWN_FIELDS` hold."""
OWNED_FLAGS = {flag: name for name, record in RECORDS.items() for flag in record.owned_flags}
"""vllm_extra_args flags whose value gpufleet writes itself, each with the variable that sets it."""
OWNED_ENV = {env: name for name, record in RECORDS.items() for env in record.owned_env} | GPUFLEET_ENV
"""Environment variables gpufleet sets itself on vLLM and Ray processes, each with what sets it."""
