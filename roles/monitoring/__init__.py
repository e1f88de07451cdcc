"""Role ``monitoring``: Prometheus and Alertmanager on the hosts of the inventory group ``monitoring``.

After it, a monitoring host has:

- Debian's ``prometheus`` and ``prometheus-alertmanager`` packages (without the recommended node_exporter package:
  role node_exporter's), ``prometheus.service`` and
  ``prometheus-alertmanager.service`` running and enabled, each with the drop-in ``<unit>.d/gpufleet.conf``:
  gpufleet's flags (Debian's ``/etc/default/`` file is not read), gpufleet's sandbox (its data directory below
  ``/var/lib/prometheus/`` the only place it writes), and skipped until gpufleet's configuration exists (the
  package starts the service as it is installed);
- ``/etc/prometheus/gpufleet/`` (root, 0755):

  - ``prometheus.yml`` (0644): every scrape job and target from the inventory and the plan
    (:mod:`gpufleet.monitoring.scrape_config`), the Alertmanager, and the rule files with the SHA-256 they were
    checked with;
  - ``rules/``: gpufleet's recording and alert rules (:mod:`gpufleet.monitoring.alert_rules`) and
    ``gpufleet-plan.yml``, the plan's figures (:mod:`gpufleet.monitoring.plan_rules`);
  - ``alertmanager.yml`` (root:prometheus, 0640): one receiver, the alert log and ``alertmanager_webhook_url``'s
    webhook when one is set;

  each written to ``/etc/prometheus/gpufleet-candidate/`` first and checked there (``promtool check config``,
  ``promtool check rules``, ``amtool check-config``) before it replaces the one in use: a configuration they
  refuse never reaches the running service;
- ``gpufleet-alert-log.service`` (Debian's ``python3``), running and enabled: role common's node tool
  ``alert_log.py`` as the ``prometheus`` account, sandboxed, on ``127.0.0.1:alertmanager_log_port``; it writes
  every alert Alertmanager sends it, firing and resolved, as one line to the journal (with no webhook set, alerts
  are logged only);
- Prometheus on ``<fleet address>:prometheus_port``, its samples kept ``prometheus_retention``; Alertmanager on
  ``alertmanager_listen_address:alertmanager_port`` (127.0.0.1:9093), without clustering.
- where Grafana is installed (``/etc/grafana/provisioning/dashboards/`` exists): gpufleet's dashboards
  (:mod:`gpufleet.monitoring.dashboards`) in ``/var/lib/grafana/dashboards/gpufleet/`` and the file provider that
  loads them.

A changed configuration or rule file is reloaded (SIGHUP: no restart, no gap in the samples); a changed drop-in
restarts its service.

``start_records()``, last in the site sequence: on a monitoring host, the start record of each release on each shape
(:mod:`gpufleet.measure.starts`), the fastest start of each the deploys have timed, one JSON file each in
``/var/lib/gpufleet/starts/`` (root, 0644), replaced only by a faster start; the records of the releases and shapes
the plan serves for node_exporter in ``/var/lib/node_exporter/textfile_collector/gpufleet-start-records.prom``
(``gpufleet_replica_start_record_seconds``), what the alert ReplicaStartSlow compares each replica's start with.

Variables: roles/monitoring/defaults.yml. The fleet lets the monitoring hosts in
(:func:`gpufleet.plan.access.monitoring_sources`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import yaml
from pyinfra.api.deploy import deploy
from pyinfra.api.operation import OperationMeta
from pyinfra.context import host

from gpufleet import templates
from gpufleet.config.fleet import Fleet
from gpufleet.config.inventory_shape import MONITORING_GROUP, ROUTERS_GROUP
from gpufleet.config.schema import HostConfig
from gpufleet.facts.bench import BenchRecords
from gpufleet.gpu.profiles import profile_facts
from gpufleet.gpu.report import NodeFacts
from gpufleet.inventory.load import loaded_inventory
from gpufleet.measure.capacity import releases_without_bench
from gpufleet.measure.records import Record
from gpufleet.measure.starts import START_RECORDS_DIR, start_key
from gpufleet.monitoring import ceiling_rules, dashboards
from gpufleet.monitoring.alert_rules import render_rules
from gpufleet.monitoring.plan_rules import plan_rules
from gpufleet.monitoring.scrape_config import (
    Target,
    host_targets,
    prometheus_config,
    replica_targets,
    router_models,
    scrape_configs,
)
from gpufleet.netaddr import host_port
from gpufleet.node_paths import (
    ALERT_LOG_SERVICE,
    NODE_PYTHON,
    NODE_TOOLS_DIR,
    NODES_DIR,
    PROMETHEUS_UNIT,
    START_RECORDS_TEXTFILE,
    node_tool,
    unit_path,
)
from gpufleet.operations import apt, files, lifecycle, node, server, systemd, vllm
from gpufleet.plan import access
from gpufleet.plan.planner import FleetPlan, plan_fleet
from gpufleet.pyinfra_seam import current_state
from gpufleet.run.context import DeployContext, context, fleet, host_config
from gpufleet.units.escape import exec_line
from gpufleet.values.problems import ConfigError, exit_with
from roles.common import NODE_SOURCES

GRAFANA_UNIT = "grafana-server.service"  # Grafana's Debian package (Grafana's own repository)

ACCOUNT = "prometheus"  # Debian's account for both services
CONFIG_DIR = "/etc/prometheus/gpufleet"
CANDIDATE_DIR = "/etc/prometheus/gpufleet-candidate"  # checked there before it replaces CONFIG_DIR's files
PROMETHEUS_YML = "prometheus.yml"
ALERTMANAGER_YML = "alertmanager.yml"
RULES_DIR = "rules"  # below CONFIG_DIR, and as prometheus.yml names its rule files (relative to itself)
PLAN_RULES = "gpufleet-plan.yml"
RECEIVER = "gpufleet"
ALERT_LOG_FILE = unit_path(ALERT_LOG_SERVICE)
ALERT_LOG_PACKAGES = ["python3"]  # alert_log.py's interpreter, NODE_PYTHON


@dataclass(frozen=True)
class Service:
    """One of the two Debian services and what gpufleet's drop-in gives it."""

    package: str
    program: str
    config: str  # the configuration file it runs with
    state_directory: str  # below /var/lib: its data (systemd's StateDirectory=)

    @property
    def unit(self) -> str:
        return f"{self.package}.service"

    @property
    def drop_in_dir(self) -> str:
        return f"{unit_path(self.unit)}.d"

    @property
    def drop_in(self) -> str:
        return f"{self.drop_in_dir}/gpufleet.conf"


PROMETHEUS = Service(PROMETHEUS_UNIT.removesuffix(".service"), "/usr/bin/prometheus", f"{CONFIG_DIR}/{PROMETHEUS_YML}",
                     "prometheus/metrics2")
ALERTMANAGER = Service("prometheus-alertmanager", "/usr/bin/prometheus-alertmanager",
                       f"{CONFIG_DIR}/{ALERTMANAGER_YML}", "prometheus/alertmanager")
SERVICES = (PROMETHEUS, ALERTMANAGER)


# --- what a monitoring host gets, as plain data (tested without a node) ---------------------------------------

@dataclass(frozen=True)
class FleetView:
    """What Prometheus is configured from: every host, the GPU hosts, the routers, the replicas, the GPUs."""

    configs: Mapping[str, HostConfig]  # every host of the inventory
    pools: Mapping[str, str]  # each host's pool label: its serving pool, else its role group
    gpu_hosts: list[str]  # the hosts that serve (dcgm-exporter)
    routers: list[str]
    plan: FleetPlan  # the served models and their replicas
    node_gpus: Mapping[str, int]  # GPUs each host should report (0: a host that serves nothing)


def fleet_view(fleet: Fleet, plan: FleetPlan, facts: Mapping[str, NodeFacts], routers: list[str]) -> FleetView:
    """The view of ``fleet`` planned into ``plan`` from ``facts``; a serving host without facts has no GPU count."""
    pools = {h: loaded.label_of(h) if (loaded := loaded_inventory(h)) is not None else "all" for h in fleet.hosts}
    serving = [h for h in fleet.hosts if fleet.serves(h)]
    node_gpus = {h: len(facts[h].gpus) if fleet.serves(h) else 0 for h in fleet.hosts
                 if h in facts or not fleet.serves(h)}
    return FleetView(fleet.configs, pools, serving, routers, plan, node_gpus)


def targets(view: FleetView) -> list[Target]:
    """Every scrape target of the fleet."""
    return (host_targets(view.configs, view.pools, view.gpu_hosts, view.routers)
            + replica_targets(view.plan.replicas, view.configs))


def rule_files(cfg: HostConfig, view: FleetView) -> dict[str, str]:
    """Every rule file's text by its name: gpufleet's rules with this host's thresholds, and the plan's figures."""
    header = ("# Written by gpufleet (role monitoring) from the plan (gpufleet.monitoring.plan_rules): the facts\n"
              "# gpufleet's rules compare with.\n")
    return {**render_rules(cfg), PLAN_RULES: plan_rules(view.node_gpus, view.plan, cfg.alert_model_replicas_min_ratio,
                                                        header, cfg.gpu_hour_cost)}


def alertmanager_target(cfg: HostConfig) -> str:
    """Where Prometheus sends its alerts: Alertmanager's address (loopback when it listens on every address)."""
    address = cfg.alertmanager_listen_address
    if ipaddress.ip_address(address).is_unspecified:
        address = "127.0.0.1" if ipaddress.ip_address(address).version == 4 else "::1"
    return host_port(address, cfg.alertmanager_port)


def prometheus_yml(cfg: HostConfig, view: FleetView, rules: Mapping[str, str]) -> str:
    """prometheus.yml: the fleet's jobs, the Alertmanager, and ``rules`` (named with their SHA-256: a changed rule
    file changes this file, which is what the deploy compares)."""
    names = [f"{RULES_DIR}/{name}" for name in rules]
    digests = "".join(f"#   {name} sha256:{hashlib.sha256(text.encode()).hexdigest()}\n"
                      for name, text in zip(names, rules.values(), strict=True))
    header = ("# Written by gpufleet (role monitoring) from the inventory and the plan, and checked with promtool\n"
              "# (with these rule files) before it replaced the one in use:\n" + digests +
              f"# and the models' measured ceilings, {ceiling_rules.RULE_PATTERN}, written by gpufleet bench\n")
    jobs = scrape_configs(targets(view), router_models(view.plan))
    return prometheus_config(jobs, alertmanager_target(cfg), [*names, ceiling_rules.RULE_PATTERN], header,
                             cfg.prometheus_scrape_interval_s)


def alert_log_url(cfg: HostConfig) -> str:
    """Where Alertmanager reaches the alert log."""
    return f"http://{host_port('127.0.0.1', cfg.alertmanager_log_port)}/"


def alertmanager_yml(cfg: HostConfig) -> str:
    """alertmanager.yml: every alert to one receiver, the alert log and the webhook of ``alertmanager_webhook_url``
    when one is set."""
    urls = [alert_log_url(cfg), *([cfg.alertmanager_webhook_url] if cfg.alertmanager_webhook_url else [])]
    receiver = {"name": RECEIVER, "webhook_configs": [{"url": url, "send_resolved": True} for url in urls]}
    config = {
        "route": {"receiver": RECEIVER, "group_by": ["alertname", "model", "node"],
                  "group_wait": f"{cfg.alertmanager_group_wait_s}s",
                  "group_interval": f"{cfg.alertmanager_group_interval_s}s",
                  "repeat_interval": f"{cfg.alertmanager_repeat_interval_s}s"},
        "receivers": [receiver],
    }
    where = f"to the alert log ({ALERT_LOG_SERVICE})" + (
        " and to alertmanager_webhook_url" if cfg.alertmanager_webhook_url else
        " only (alertmanager_webhook_url is null)")
    header = (f"# Written by gpufleet (role monitoring) and checked with amtool before it replaced the one in use.\n"
              f"# Every alert goes {where}.\n")
    return header + yaml.safe_dump(config, sort_keys=False, width=1000)


def prometheus_argv(cfg: HostConfig, address: str) -> list[str]:
    return [PROMETHEUS.program, f"--config.file={PROMETHEUS.config}",
            f"--storage.tsdb.path=/var/lib/{PROMETHEUS.state_directory}/",
            f"--storage.tsdb.retention.time={cfg.prometheus_retention}",
            f"--web.listen-address={host_port(address, cfg.prometheus_port)}"]


def alertmanager_argv(cfg: HostConfig) -> list[str]:
    return [ALERTMANAGER.program, f"--config.file={ALERTMANAGER.config}",
            f"--storage.path=/var/lib/{ALERTMANAGER.state_directory}/",
            f"--web.listen-address={host_port(cfg.alertmanager_listen_address, cfg.alertmanager_port)}",
            "--cluster.listen-address="]  # empty: no cluster port, no gossip with other Alertmanagers


def alert_log_unit(cfg: HostConfig) -> str:
    """gpufleet-alert-log.service: alert_log.py on ``alertmanager_log_port``, as Debian's Prometheus account,
    loopback only. It names the tool's SHA-256, so that a new tool changes the unit, which restarts it."""
    tool = hashlib.sha256((NODE_SOURCES / "alert_log.py").read_bytes()).hexdigest()
    argv = [NODE_PYTHON, "-I", node_tool("alert_log.py"), "--port", str(cfg.alertmanager_log_port)]
    return templates.render("monitoring/gpufleet-alert-log.service.j2", node_tools=NODE_TOOLS_DIR,
                            service=ALERT_LOG_SERVICE, alertmanager=ALERTMANAGER.unit, account=ACCOUNT,
                            exec_start=exec_line(argv), tool_sha256=tool, ip_access=access.unit_lines([]))


def drop_in(service: Service, argv: list[str], allowed: list[str] | None) -> str:
    """The service's drop-in: ``argv`` as its command line, the sandbox, ``allowed`` as its IP filter (None: none)."""
    return templates.render("monitoring/override.conf.j2", unit=service.unit,
                            environment_file=f"/etc/default/{service.package}", config=service.config,
                            exec_start=exec_line(argv), state_directory=service.state_directory,
                            ip_access=access.unit_lines(allowed))


@dataclass(frozen=True)
class MonitoringFiles:
    """Everything a monitoring host is given: file texts by their path below CONFIG_DIR, and the drop-ins."""

    configs: dict[str, str]
    prometheus_drop_in: str
    alertmanager_drop_in: str
    alert_log_unit: str


def monitoring_files(cfg: HostConfig, address: str, view: FleetView, group_hosts: list[str]) -> MonitoringFiles:
    """The files of a monitoring host at ``address`` (its fleet address); ``group_hosts``: the monitoring hosts'
    addresses. Raises ConfigError for a Prometheus IP filter that would need a host name."""
    rules = rule_files(cfg, view)
    configs = {PROMETHEUS_YML: prometheus_yml(cfg, view, rules), ALERTMANAGER_YML: alertmanager_yml(cfg),
               **{f"{RULES_DIR}/{name}": text for name, text in rules.items()}}
    scraped = sorted({t.host for t in targets(view)})
    allowed = access.prometheus_sources(cfg, address, scraped, group_hosts)
    alerts_from = access.alertmanager_sources(cfg, address, group_hosts)
    return MonitoringFiles(configs, drop_in(PROMETHEUS, prometheus_argv(cfg, address), allowed),
                           drop_in(ALERTMANAGER, alertmanager_argv(cfg), alerts_from), alert_log_unit(cfg))


# --- the running deploy's view ---------------------------------------------------------------------------------

def monitored_plan(ctx: DeployContext) -> tuple[FleetPlan, dict[str, NodeFacts]]:
    """The plan Prometheus watches, and the facts it was made with: the deploy's plan, in which a host
    that failed its gate (or could not be probed) but declares a ``gpu_profile`` is planned from its profile, so that
    its replicas are still expected (and alerted on) while it is down. A host without either is left out, as the
    deploy leaves it out."""
    facts = {h: ctx.provisional.get(h, f) for h, f in ctx.facts.items() if h not in ctx.gate_failures}
    declared = {h: profile_facts(str(ctx.fleet.configs[h].gpu_profile), h) for h in ctx.fleet.hosts
                if ctx.fleet.serves(h) and h not in facts and ctx.fleet.configs[h].gpu_profile}
    if not declared:
        return ctx.plan, facts
    facts |= declared
    pools = {pool: kept for pool, hosts in ctx.fleet.pools.items() if (kept := [h for h in hosts if h in facts])}
    planned = Fleet(ctx.fleet.inventory, [h for h in ctx.fleet.hosts if h in facts],
                    {h: c for h, c in ctx.fleet.configs.items() if h in facts}, pools)
    return plan_fleet(planned, facts), facts


def group_members(group: str) -> list[str]:
    """The names of the running deploy's hosts in an inventory group ([] without the group)."""
    try:
        return [member.name for member in current_state().inventory.get_group(group)]
    except Exception:  # noqa: BLE001 - pyinfra raises NoGroupError for a group the inventory does not define
        return []


def deploy_files(cfg: HostConfig, address: str) -> MonitoringFiles:
    """:func:`monitoring_files` for the running deploy (it probes and plans the fleet once). Exits 2 on bad input."""
    plan, facts = monitored_plan(context())
    view = fleet_view(fleet(), plan, facts, group_members(ROUTERS_GROUP))
    try:
        return monitoring_files(cfg, address, view, access.deploy_group())
    except ConfigError as error:
        exit_with(error)


# --- the deploy ----------------------------------------------------------------------------------------------------

def is_monitoring() -> bool:
    """Whether the current host is in the inventory group ``monitoring``."""
    return MONITORING_GROUP in host.groups


def _check_and_install(service: Service, names: list[str], check: str, group: str, mode: str) -> str:
    """The shell script that checks the candidates (``check``, run in the candidate directory) and then moves each
    of ``names`` into CONFIG_DIR, the service's configuration last."""
    steps = ["set -e", f"cd {shlex.quote(CANDIDATE_DIR)}", check]
    ordered = [n for n in names if f"{CONFIG_DIR}/{n}" != service.config] + [service.config.rpartition("/")[2]]
    for name in ordered:
        live = shlex.quote(f"{CONFIG_DIR}/{name}")
        steps.append(f"install -o root -g {group} -m {mode} {shlex.quote(name)} {live}.gpufleet-new")
        steps.append(f"mv -fT {live}.gpufleet-new {live}")
    return "; ".join(steps)


def _only(changed: OperationMeta, restarted: OperationMeta) -> Callable[[], bool]:
    """Whether ``changed`` changed the node and ``restarted`` did not (a restart reads the configuration anyway)."""
    return lambda: changed.did_change() and not restarted.did_change()


def grafana_installed() -> bool:
    """Whether the host has Grafana: its provisioning directory for dashboards exists (as read by the role's
    observe)."""
    return node.path(dashboards.GRAFANA_PROVISIONING_DIR).get("type") == "directory"


def grafana_dashboards() -> None:
    """gpufleet's dashboards in Grafana's provisioning (a file provider and the dashboards it loads), where Grafana
    is installed; nothing where it is not. Grafana rescans the dashboards every minute and reads a changed provider
    file when it restarts."""
    def installed() -> bool:  # asked when each operation runs, after the role's observe
        return grafana_installed()

    files.directory(name=f"Create {dashboards.GRAFANA_DASHBOARDS_DIR} (where Grafana is installed)",
                    path=dashboards.GRAFANA_DASHBOARDS_DIR, _if=installed)
    written = {dest: files.file(name=f"Write the Grafana file {dest}", dest=dest, content=text, _if=installed)
               for dest, text in sorted(dashboards.grafana_files().items())}
    provider = written[f"{dashboards.GRAFANA_PROVISIONING_DIR}/{dashboards.PROVIDER_FILE}"]
    systemd.restart(name="Restart grafana-server: its dashboard provider changed", unit=GRAFANA_UNIT,
                    _if=lambda: installed() and provider.did_change())


def bench_notices() -> list[str]:
    """On a monitoring host: a line for each served model whose planned release has no bench record while an
    earlier release has one (``deploys/check.py`` prints them; they fail nothing)."""
    if not is_monitoring():
        return []
    records = [Record.from_json(doc) for doc in host.get_fact(BenchRecords)]
    ctx = context()
    return releases_without_bench(ctx.plan.replicas, records)


@deploy("Monitoring (Prometheus, Alertmanager)")
def monitoring() -> None:
    """Converge Prometheus and Alertmanager on a monitoring host: packages, sandboxed units, checked configuration."""
    if not is_monitoring():
        return
    cfg = host_config()
    wanted = deploy_files(cfg, cfg.fleet_address or host.name)
    rules = sorted(n for n in wanted.configs if n.startswith(f"{RULES_DIR}/"))
    node.observe(name="Read Prometheus's and Alertmanager's packages, units and configuration",
                 packages=[*(s.package for s in SERVICES), *ALERT_LOG_PACKAGES],
                 units=[*(s.unit for s in SERVICES), ALERT_LOG_SERVICE],
                 paths=[*(p for s in SERVICES for p in (s.drop_in_dir, s.drop_in)), ALERT_LOG_FILE, CONFIG_DIR,
                        CANDIDATE_DIR,
                        f"{CONFIG_DIR}/{RULES_DIR}", f"{CANDIDATE_DIR}/{RULES_DIR}",
                        *(f"{d}/{n}" for d in (CONFIG_DIR, CANDIDATE_DIR) for n in (PROMETHEUS_YML, ALERTMANAGER_YML)),
                        *(f"{CANDIDATE_DIR}/{n}" for n in rules), dashboards.GRAFANA_PROVISIONING_DIR,
                        dashboards.GRAFANA_DASHBOARDS_DIR, *dashboards.grafana_files()],
                 listings=[f"{CANDIDATE_DIR}/{RULES_DIR}/*", f"{CONFIG_DIR}/{RULES_DIR}/*"])
    units: dict[Service, OperationMeta] = {}
    for service, text in ((PROMETHEUS, wanted.prometheus_drop_in), (ALERTMANAGER, wanted.alertmanager_drop_in)):
        files.directory(name=f"Create {service.drop_in_dir}", path=service.drop_in_dir)
        units[service] = files.file(name=f"Write the drop-in {service.drop_in} (flags, sandbox)", dest=service.drop_in,
                                    content=text)
    alert_log = files.file(name=f"Write the alert log's unit {ALERT_LOG_FILE}", dest=ALERT_LOG_FILE,
                           content=wanted.alert_log_unit)
    systemd.daemon_reload(name="Reload systemd: a monitoring unit or drop-in changed",
                          _if=lambda: alert_log.did_change() or any(op.did_change() for op in units.values()))
    # Without recommends: Debian's prometheus recommends its node_exporter package, which role node_exporter owns.
    apt.packages(name="Install Prometheus, Alertmanager and Python (the distribution's packages)",
                 packages=[*(s.package for s in SERVICES), *ALERT_LOG_PACKAGES], no_recommends=True,
                 update_first=True)
    # Before Alertmanager's configuration names it: the first alerts find it listening.
    systemd.restart(name=f"Restart {ALERT_LOG_SERVICE}: its unit changed", unit=ALERT_LOG_SERVICE,
                    _if=alert_log.did_change)
    systemd.service(name=f"Ensure {ALERT_LOG_SERVICE} runs and starts at boot", unit=ALERT_LOG_SERVICE, running=True,
                    enabled=True)
    for directory in (CONFIG_DIR, f"{CONFIG_DIR}/{RULES_DIR}", CANDIDATE_DIR, f"{CANDIDATE_DIR}/{RULES_DIR}"):
        files.directory(name=f"Create {directory}", path=directory)
    files.pruned(name=f"Remove rule files gpufleet no longer writes from {CANDIDATE_DIR}/{RULES_DIR}",
                 pattern=f"{CANDIDATE_DIR}/{RULES_DIR}/*", keep=[f"{CANDIDATE_DIR}/{n}" for n in rules])
    for name in [*rules, PROMETHEUS_YML]:
        files.file(name=f"Write {name} to check ({CANDIDATE_DIR})", dest=f"{CANDIDATE_DIR}/{name}",
                   content=wanted.configs[name])
    checks = f"promtool check config {PROMETHEUS_YML}; promtool check rules {' '.join(shlex.quote(n) for n in rules)}"
    changed = {PROMETHEUS: server.script(
        name=f"Check the configuration and rules with promtool, then put them in place ({CONFIG_DIR})",
        script=_check_and_install(PROMETHEUS, [*rules, PROMETHEUS_YML], checks, "root", "0644"),
        done_file=PROMETHEUS.config, done_sha256=hashlib.sha256(wanted.configs[PROMETHEUS_YML].encode()).hexdigest(),
    )}
    files.file(name=f"Write {ALERTMANAGER_YML} to check ({CANDIDATE_DIR})", dest=f"{CANDIDATE_DIR}/{ALERTMANAGER_YML}",
               content=wanted.configs[ALERTMANAGER_YML], group=ACCOUNT, mode="0640")
    changed[ALERTMANAGER] = server.script(
        name=f"Check Alertmanager's configuration with amtool, then put it in place ({ALERTMANAGER.config})",
        script=_check_and_install(ALERTMANAGER, [ALERTMANAGER_YML], f"amtool check-config {ALERTMANAGER_YML}",
                                  ACCOUNT, "0640"),
        done_file=ALERTMANAGER.config,
        done_sha256=hashlib.sha256(wanted.configs[ALERTMANAGER_YML].encode()).hexdigest(),
    )
    files.pruned(name=f"Remove rule files gpufleet no longer writes from {CONFIG_DIR}/{RULES_DIR}",
                 pattern=f"{CONFIG_DIR}/{RULES_DIR}/*", keep=[f"{CONFIG_DIR}/{n}" for n in rules])
    for service in SERVICES:
        unit, config = units[service], changed[service]
        systemd.restart(name=f"Restart {service.unit}: its drop-in changed", unit=service.unit, _if=unit.did_change)
        systemd.reload(name=f"Reload {service.unit}: its configuration changed", unit=service.unit,
                       _if=_only(config, unit))
        systemd.service(name=f"Ensure {service.unit} runs and starts at boot", unit=service.unit, running=True,
                        enabled=True)
    grafana_dashboards()


@deploy("Monitoring: keep the nodes' records")
def node_records() -> None:
    """Every host adds it, from one line of the site sequence after every role, as :func:`start_records`: pyinfra runs
    it once every node's admission and the reading of its record have run. It keeps the fleet's copy of each node's
    record on the monitoring hosts (``/var/lib/gpufleet/nodes/<host>.json``) and is skipped on every other host."""
    ctx = context()
    lifecycle.keep_records(name="Keep the fleet's copy of each node's record", directory=NODES_DIR,
                           seen=ctx.records_seen, kept=ctx.fleet_copies.get(host.name, {}), _if=is_monitoring)


@deploy("Monitoring: keep each release's start record")
def start_records() -> None:
    """Every host adds it, from one line of the site sequence after every role: pyinfra then runs it once every
    host's earlier operations have run, each replica's readiness wait and the reading of its start among them (on a
    dedicated monitoring host, the monitoring role's operations come before the serving nodes' waits). It keeps
    the start records on the monitoring hosts and is skipped on every other host."""
    ctx = context()
    keeps = is_monitoring()
    planned = sorted({start_key(replica) for replica in ctx.plan.replicas})
    records = [f"{START_RECORDS_DIR}/{key.file_name()}" for key in planned]
    if keeps:
        node.observe(name="Read the start records of the releases served", paths=[*records, START_RECORDS_TEXTFILE],
                     texts=records)
    vllm.start_records(name="Keep each release's start record on each shape (the fastest start timed)",
                       directory=START_RECORDS_DIR, textfile=START_RECORDS_TEXTFILE,
                       planned=[key.labels() for key in planned], starts=ctx.starts, _if=lambda: keeps)
