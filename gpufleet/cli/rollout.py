"""``gpufleet upgrade`` and ``gpufleet rollback``: roll a change through the fleet behind its routers, batch by
batch, with drain, canary watch and automatic rollback (:mod:`gpufleet.rollout.runner`).

Before anything changes: the options are checked, the inventory is validated (``--data`` included) and planned as
``gpufleet plan`` plans it, ``--canary-bench``'s prerequisites are checked (a monitoring group, each replica's API
key, the client), all before any host is contacted; then the routers and the nodes' release records are read, and
the batches are planned; any refusal is one line per problem and exit 2. Then the rollout runs; exit 0 when it is
done, 1 when it stopped (its report says where and why), 130 when interrupted (drained replicas put back first).
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import click
from click.core import ParameterSource
from pyinfra.api.inventory import Inventory

from gpufleet.cli.diag import capture
from gpufleet.cli.inputs import DATA_OPTION, cli_fleet, fail_lines, fleet_facts, prometheus_url
from gpufleet.config.fleet import Fleet
from gpufleet.config.inventory_shape import MONITORING_GROUP, ROUTERS_GROUP
from gpufleet.config.secrets import read_secret
from gpufleet.inventory.load import load_fleet, parse_data_args, set_data_override
from gpufleet.measure.guidellm_client import ClientError, Target, client_path, workload_for
from gpufleet.plan import virtual_address
from gpufleet.plan.planner import FleetPlan, plan_fleet
from gpufleet.remote.bench_store import read_records as read_bench_records
from gpufleet.remote.commands import PyinfraRemote
from gpufleet.remote.gpu_probe import load_inventory
from gpufleet.rollout.batches import DEFAULT_BATCHES, RolloutError, plan_rollout
from gpufleet.rollout.canary import DEFAULT_MAX_ERROR_RATIO, DEFAULT_MAX_LATENCY_RATIO, Thresholds
from gpufleet.rollout.canary_bench import GuidellmCanaryBench
from gpufleet.rollout.latency import DEFAULT_MIN_REQUESTS, MAX_WATCH_FACTOR, MAX_WATCH_S, PrometheusLatency
from gpufleet.rollout.node_releases import RecordFailure, read_records
from gpufleet.rollout.options import check_options
from gpufleet.rollout.pyinfra_run import DEPLOY, PROJECT_ROOT, PyinfraDeploy, pyinfra_program
from gpufleet.rollout.release import changes
from gpufleet.rollout.replicas import ROLLBACK, UPGRADE, Rollable, rollable
from gpufleet.rollout.report import ROLLED, ROLLED_BACK
from gpufleet.rollout.router_control import RouterControl, RouterFailure
from gpufleet.rollout.runner import DEFAULT_CANARY_S, LatencyJudge, Options, Rollout
from gpufleet.values.problems import ConfigError

EXIT_FAILED = 1


def _options(command: Callable[..., None]) -> Callable[..., None]:
    for option in reversed([
        click.option("--batches", default=DEFAULT_BATCHES, show_default=True,
                     help="Batch sizes, canary first: replicas (N) or a share of them (P%); the last repeats."),
        click.option("--max-unavailable", default="1", show_default=True,
                     help="Most replicas of a model out at once: N or P% of its replicas."),
        click.option("--min-available", default="1", show_default=True,
                     help="Fewest replicas of a model serving at any time: N or P%; refused when rolling would"
                          " go below it."),
        click.option("--canary-s", default=str(DEFAULT_CANARY_S), show_default=True,
                     help="Seconds the first batch is watched after it is back in the routers (at most 86400). 0: no"
                          " canary watch, the one way to roll without judging a canary (refused with the other"
                          " --canary-* options)."),
        click.option("--canary-every-batch", is_flag=True, help="Watch every batch, not only the first."),
        click.option("--max-error-ratio", default=str(DEFAULT_MAX_ERROR_RATIO),
                     show_default=True, help="How much more of its requests a canary may answer 5xx than the"
                                             " model's replicas not rolled yet (0 to 1)."),
        click.option("--max-latency-ratio", default=str(DEFAULT_MAX_LATENCY_RATIO),
                     show_default=True, help="How many times a canary's p95 time to first token or inter-token"
                                             " latency (vLLM's, from the monitoring hosts' Prometheus) may be that of"
                                             " its shape's replicas not rolled yet or of its release's bench record;"
                                             " without a monitoring group, how many times as much as theirs the"
                                             " routers' mean response time may grow (1 to 1000)."),
        click.option("--canary-bench", is_flag=True,
                     help="Before a canary takes traffic, bench it on its own API for 20 s at half its release's"
                          " measured ceiling per replica (gpufleet bench's record; the controller runs the client and"
                          " must be in vllm_api_allowed_from) and judge it like the watch: a canary its bench judged"
                          " needs no --canary-min-requests from the routers."),
        click.option("--canary-min-requests", "min_requests", default=str(DEFAULT_MIN_REQUESTS), show_default=True,
                     help="Requests a canary must serve over its watch to be judged (its peers too, to be its"
                          " reference). Short of them the watch goes on, up to --canary-max-s; a canary still short"
                          " then fails, unless its --canary-bench judged it."),
        click.option("--canary-max-s", "canary_max_s", metavar="SECONDS",
                     help=f"The longest a watch goes on while a canary has served fewer than --canary-min-requests"
                          f" (default: {MAX_WATCH_FACTOR:g} times --canary-s, at most {MAX_WATCH_S:g}; from --canary-s"
                          f" to {MAX_WATCH_S:g})."),
        click.option("--facts", "facts_dir", type=click.Path(file_okay=False, path_type=Path),
                     help="Plan from probed facts (<host>.json from `gpufleet probe`); default: declared gpu_profile."),
        click.option("--report", "report_path", type=click.Path(path_type=Path),
                     help="Also write the report as JSON to this file (in a directory that exists)."),
        DATA_OPTION,
    ]):
        command = option(command)
    return command


@click.command("upgrade")
@click.argument("inventory")
@_options
def upgrade_command(inventory: str, **options: Any) -> None:
    """Roll the inventory's configuration through the fleet, batch by batch behind the routers: drain, deploy,
    put back, canary watch; any failure rolls that batch's replicas back and stops."""
    _roll(UPGRADE, inventory, **options)


@click.command("rollback")
@click.argument("inventory")
@_options
def rollback_command(inventory: str, **options: Any) -> None:
    """Return every replica to its previous release (release.previous.json on its nodes) the same rolling way;
    replicas without one are left untouched. The inventory still says otherwise: change it too."""
    _roll(ROLLBACK, inventory, **options)


def _canary_prerequisites(hosts: Inventory, fleet: Fleet, plan: FleetPlan,
                          canary_bench: bool) -> tuple[list[str], GuidellmCanaryBench | None]:
    """The monitoring hosts (where the bench records are kept; none without a monitoring group) and, with
    ``canary_bench``, the client that benches each canary: checked before any host is contacted, one line and exit 2
    when ``--canary-bench`` has no monitoring group, a replica's ``vllm_api_key`` cannot be read, or the client is
    not installed."""
    monitors = [host.name for host in hosts.get_group(MONITORING_GROUP, [])]
    if not monitors or monitors[0] not in fleet.configs:
        if canary_bench:
            fail_lines(["--canary-bench: expected a monitoring group (where the bench records are kept), found none"])
        return [], None
    return monitors, _canary_bench(plan) if canary_bench else None


def _latency_judge(inventory: str, override: dict[str, Any] | None, fleet: Fleet, monitors: list[str],
                   max_ratio: float, bench: GuidellmCanaryBench | None) -> LatencyJudge | None:
    """The canary's latency judge on the first monitoring host's Prometheus, with the bench records kept there
    (and ``bench``, the client that benches each canary with ``--canary-bench``); None without a monitoring group
    (the routers' mean response time is judged then). The records are read over an inventory of their own (pyinfra's
    states do not share one)."""
    if not monitors:
        return None
    records, unread = read_bench_records(load_inventory(inventory, override), monitors)
    for line in unread:
        click.echo(f"warning: {line}: canaries are compared with their peers only", err=True)
    return LatencyJudge(PrometheusLatency(prometheus_url(fleet, monitors[0])), records, max_ratio, bench)


def _canary_bench(plan: FleetPlan) -> GuidellmCanaryBench:
    """The client and each replica's own API, key and workload, for ``--canary-bench``."""
    targets, workloads = {}, {}
    for replica in plan.replicas:
        try:
            key = read_secret(replica.api_key, "vllm_api_key") if replica.api_key else None
        except ConfigError as error:
            fail_lines([problem.line() for problem in error.problems])
        targets[replica.name] = Target(replica.api_url, replica.served, key, None,
                                       plan.model_of(replica).tokenizer)
        workloads[replica.name] = workload_for(replica.max_model_len)
    try:
        exe = client_path(lambda line: click.echo(f"gpufleet: {line}"))
    except ClientError as exc:
        fail_lines([f"--canary-bench: {exc}"])
    return GuidellmCanaryBench(exe, targets, workloads)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _check_targets(mode: str, inventory: str, data: tuple[str, ...], found: Rollable) -> None:
    """A rollback's ``--data`` of every distinct previous release must pass the same validation as the deploy
    that gets it: exit 2 (the problems said) before anything changes."""
    if mode != ROLLBACK:
        return
    operator = parse_data_args(list(data))
    checked: set[str] = set()
    for member in (m for members in found.members.values() for m in members if m.target is not None):
        given = {**operator, **member.data(member.target or {})}
        if repr(sorted(given.items())) in checked:
            continue
        checked.add(repr(sorted(given.items())))
        set_data_override(given)
        try:
            load_fleet(inventory, given)
        except (ConfigError, SystemExit) as exc:
            lines = exc.problems if isinstance(exc, ConfigError) else []
            fail_lines([*(p.line() for p in lines), f"replica {member.name}: its previous release"
                   f" ({changes(member.inventory, member.target)}) does not pass the inventory's validation"])
        finally:
            set_data_override(operator)


def _roll(mode: str, inventory: str, batches: str, max_unavailable: str, min_available: str, canary_s: str,
          canary_every_batch: bool, max_error_ratio: str, max_latency_ratio: str, canary_bench: bool,
          min_requests: str, canary_max_s: str | None, facts_dir: Path | None, report_path: Path | None,
          data: tuple[str, ...]) -> None:
    source = click.get_current_context().get_parameter_source("min_requests")
    watch_options = [option for option, on in (("--canary-every-batch", canary_every_batch),
                                               ("--canary-bench", canary_bench),
                                               ("--canary-min-requests", source not in (None, ParameterSource.DEFAULT)))
                     if on]
    try:
        checked = check_options(batches, max_unavailable, min_available, canary_s, max_error_ratio,
                                max_latency_ratio, report_path, min_requests, canary_max_s, watch_options)
    except RolloutError as exc:
        fail_lines(exc.problems)
    fleet = cli_fleet(inventory, data)
    override = parse_data_args(list(data)) or None
    hosts = load_inventory(inventory, override)
    routers = [host.name for host in hosts.get_group(ROUTERS_GROUP, [])]
    if not routers:
        fail_lines([f"{inventory}: no `{ROUTERS_GROUP}` group: a rolling {mode} takes each replica out of the routers"
               f" before it changes it; add routers (docs/guide/routers.md) or use the plain deploy"
               f" (pyinfra {inventory} {DEPLOY})"])
    plan = plan_fleet(fleet, fleet_facts(fleet, facts_dir))
    if plan.problems:
        fail_lines([problem.line() for problem in plan.problems])
    if endpoint := virtual_address.endpoint_line(routers, fleet.configs):
        click.echo(f"gpufleet {mode}: {endpoint}; each replica is drained on every router, through its own"
                   f" HAProxy: {', '.join(routers)}")
    program = pyinfra_program()
    if program is None or not (PROJECT_ROOT / DEPLOY).is_file():
        fail_lines([f"gpufleet {mode}: expected pyinfra beside {sys.executable} and {DEPLOY} in {PROJECT_ROOT}"])
    monitors, bench = _canary_prerequisites(hosts, fleet, plan, canary_bench)
    backends = {replica.name: plan.model_of(replica).backend for replica in plan.replicas}
    remote = PyinfraRemote(hosts)
    try:
        router = RouterControl(remote, routers)
        try:
            view = router.show()
            recorded: dict[str, list[str]] = {}
            for replica in plan.replicas:
                for role in replica.roles:
                    if any(process.unit == "vllm" for process in role.processes):
                        recorded.setdefault(role.host, []).append(replica.name)
            records = {node: read_records(remote, node, names) for node, names in recorded.items()}
        except (RouterFailure, RecordFailure) as exc:
            click.echo(f"gpufleet {mode}: {exc}", err=True)
            raise SystemExit(EXIT_FAILED) from None
        found, problems = rollable(plan.replicas, fleet.configs, backends, view, records, mode)
        if problems:
            fail_lines(problems)
        _check_targets(mode, inventory, data, found)
        models = {unit.model for unit in found.units}
        try:
            planned = plan_rollout(found.units, batches, ready=found.ready,
                                   max_unavailable=dict.fromkeys(models, checked.max_unavailable),
                                   min_available=dict.fromkeys(models, checked.min_available),
                                   changing={name for name, members in found.members.items()
                                             if any(m.changes_release for m in members)})
        except RolloutError as exc:
            fail_lines(exc.problems)
        for member in (m for members in found.members.values() for m in members):
            if member.target is not None and member.before is None:
                click.echo(f"warning: replica {member.name}: no release.json on {member.recorded_on[0]} (deployed by"
                           " a gpufleet without release records?): a failure there is left drained, not rolled"
                           " back", err=True)
        options = Options(checked.canary_s, canary_every_batch,
                          Thresholds(checked.max_error_ratio, checked.max_latency_ratio),
                          _latency_judge(inventory, override, fleet, monitors, checked.max_latency_ratio, bench),
                          checked.min_requests, checked.canary_max_s)
        deployer = PyinfraDeploy(program or "pyinfra", Path(inventory), data)
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            report = Rollout(mode, found, planned, router, remote, deployer, options,
                             say=lambda line: click.echo(line)).run()
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        remote.close()
    click.echo(report.text())
    rolled_back = [m for members in found.members.values() for m in members
                   if report.outcomes[m.name].state == ROLLED_BACK]
    if rolled_back:  # the evidence of what failed, kept before anyone looks (gpufleet diag --list)
        capture(inventory, data, fleet, list(dict.fromkeys(n for m in rolled_back for n in m.nodes)),
                f"{mode} rolled back {' '.join(m.name for m in rolled_back)}")
    if report_path is not None:
        report_path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    moved = [m for members in found.members.values() for m in members if report.outcomes[m.name].state == ROLLED]
    if mode == ROLLBACK and any(m.target != m.inventory for m in moved):
        click.echo(f"gpufleet rollback: {inventory} still says otherwise: the next plain deploy (or upgrade) gives"
                   " the replicas what it says again; change the inventory to keep the previous release")
    if report.status:
        raise SystemExit(report.status)

