"""``gpufleet bench``: ramp a model's request rate through its routers (or against one replica) with guidellm until
a step misses the objective, print the ceiling, and keep the record on the monitoring hosts."""

from __future__ import annotations

import datetime
import json
import socket
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import click

from gpufleet.cli.inputs import (
    DATA_OPTION,
    Number,
    cli_fleet,
    fail_lines,
    fleet_facts,
    group_hosts,
    prometheus_url,
)
from gpufleet.config.edge import ca_path, ca_problem
from gpufleet.config.fleet import Fleet
from gpufleet.config.inventory_shape import MONITORING_GROUP, ROUTERS_GROUP
from gpufleet.config.secrets import read_secret
from gpufleet.config.settings.router import RouterClient
from gpufleet.input_files import output_file_problem
from gpufleet.inventory.load import parse_data_args
from gpufleet.measure import guidellm_client as client
from gpufleet.measure.dataset import DatasetError, load_dataset, write_for_client
from gpufleet.measure.early_stop import DRAINED_WITHIN_S, MissWatch, settled, stopped_step
from gpufleet.measure.engine_histograms import Reading, mean_between, quantile_between, read
from gpufleet.measure.engine_metrics import with_engine_metrics
from gpufleet.measure.plot import render_svg
from gpufleet.measure.ramp import (
    MAX_DOUBLINGS,
    RAMP_TOP_RPS,
    REFINE_STEPS,
    RampError,
    Slo,
    Step,
    next_rate,
    parse_rates,
    parse_slo,
    step_problem,
)
from gpufleet.measure.records import RECORDS_DIR, Record, RecordKey, layout_name
from gpufleet.plan import virtual_address
from gpufleet.plan.planner import FleetPlan, Replica, ServedModel, plan_fleet
from gpufleet.prometheus_api import PrometheusError
from gpufleet.values.problems import ConfigError

DEFAULT_STEP_S = 60.0


@dataclass(frozen=True)
class Chosen:
    """What a bench measures: the served model, the replicas behind the target, and the record's key."""

    model: ServedModel
    replicas: list[Replica]
    key: RecordKey


def _choose(plan: FleetPlan, model: str | None, replica: str | None) -> Chosen:
    """The model and replicas ``--model`` / ``--replica`` name (one line, exit 2, when they cannot be used)."""
    replicas, served = plan.replicas, list(plan.models)
    if replica is not None:
        found = [r for r in replicas if r.name == replica]
        if not found:
            fail_lines([f"gpufleet bench: --replica: expected one of {', '.join(r.name for r in replicas)},"
                        f" found {replica!r}"])
        name = found[0].served
        if model is not None and model != name:
            fail_lines([f"gpufleet bench: --replica: {replica} serves {json.dumps(name)}, not --model"
                        f" {json.dumps(model)}"])
        model, scope, chosen = name, "replica", found
    else:
        if model is None:
            if len(served) != 1:
                fail_lines([f"gpufleet bench: --model: expected one of {', '.join(map(json.dumps, served))}"
                            " (the fleet serves several), found none"])
            model = served[0]
        if model not in served:
            fail_lines([f"gpufleet bench: --model: expected a model a pool serves"
                        f" ({', '.join(map(json.dumps, served))}), found {json.dumps(model)}"])
        scope = "routers"
        chosen = [r for r in replicas if r.served == model]
    layouts = sorted({layout_name(r.tp, r.pp, r.dp) for r in chosen})
    profiles = sorted({profile for r in chosen for profile in r.gpu_profile.split("+")})
    key = RecordKey(model, chosen[0].release, "+".join(layouts), "+".join(profiles), scope)
    return Chosen(plan.models[model], chosen, key)


def _limits_the_ramp(router_client: RouterClient, rates: list[float] | None) -> str | None:
    """How a router client's limits would cap a ramp offering ``rates`` (None: the doubling ramp, up to
    :data:`RAMP_TOP_RPS`), or None: a rate limit below the ramp's top, or any concurrency limit (it caps the rate at
    the limit over a request's duration, which only the ramp measures)."""
    top = max(rates) if rates else RAMP_TOP_RPS
    limits = []
    if router_client.requests_per_s is not None and router_client.requests_per_s < top:
        limits.append(f"limited to {router_client.requests_per_s:g} req/s (the ramp offers up to {top:g})")
    if router_client.concurrent_requests is not None:
        limits.append(f"limited to {router_client.concurrent_requests:,} requests at once")
    return " and ".join(limits) or None


def _target(fleet: Fleet, chosen: Chosen, client_name: str | None, ca_file: str | None,
            rates: list[float] | None) -> client.Target:
    """Where the requests go, and with which key: the routers' endpoint, a router client's key (``--client``, else
    the first allowed the model whose limits let the ramp through) and the CA that signs the routers' certificate
    (``--ca-file``, else ``router_tls_ca``), or the one replica's own API and its ``vllm_api_key``."""
    model, tokenizer = chosen.model.name, chosen.model.tokenizer
    try:
        if chosen.key.scope == "replica":
            replica = chosen.replicas[0]
            key = read_secret(replica.api_key, "vllm_api_key") if replica.api_key else None
            return client.Target(replica.api_url, model, key, ca_file, tokenizer)
        routers = [r for r in group_hosts(fleet, ROUTERS_GROUP) if r in fleet.configs]
        if not routers:
            fail_lines(["gpufleet bench: the inventory has no routers group: bench one replica with --replica"])
        cfg = fleet.configs[routers[0]]
        trusted = ca_file or cfg.router_tls_ca
        ca_file = ca_path(trusted) if trusted else None
        allowed = [name for name, c in cfg.router_clients.items() if c.models is None or model in c.models]
        if client_name is not None and client_name not in allowed:
            fail_lines([f"gpufleet bench: --client: expected a router client allowed {json.dumps(model)}"
                        f" ({', '.join(allowed) or 'none is'}), found {client_name!r}"])
        limited = {name: why for name in allowed if (why := _limits_the_ramp(cfg.router_clients[name], rates))}
        name = client_name or next((n for n in allowed if n not in limited), allowed[0] if allowed else None)
        if name is not None and name in limited:
            fail_lines([f"gpufleet bench: --client: expected a router client whose limits let the ramp through (the"
                        f" routers' 429s would be measured as the ceiling), found {name} {limited[name]}: give the"
                        " bench a client of its own without limits"])
        key = (read_secret(cfg.router_clients[name].api_key, f"router_clients.{name}.api_key")
               if name is not None else None)
        return client.Target(virtual_address.routers_url(routers, fleet.configs), model, key, ca_file, tokenizer)
    except ConfigError as error:
        fail_lines([problem.line() for problem in error.problems])


def local_addresses(candidates: list[str]) -> list[str]:
    """Those of ``candidates`` (IP addresses) that belong to this machine: a socket binds to them."""
    found = []
    for address in candidates:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((address, 0))
            except OSError:
                continue
        found.append(address)
    return found


def _not_on_a_serving_node(fleet: Fleet) -> None:
    """Refuse to run the client on a host of a serving pool: its load would compete with what it measures."""
    serving = {virtual_address.host_address(h, fleet.configs[h]) or "": h for h in fleet.hosts if fleet.serves(h)}
    if here := local_addresses([a for a in serving if a]):
        fail_lines([f"gpufleet bench: this machine is the serving node {serving[here[0]]} ({here[0]}): run the bench"
                    " from the controller or another host that serves nothing (its load would compete with what it"
                    " measures)"])


def _progress(step: Step, slo: Slo) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:,.0f} ms"

    missed = step.missed(slo)
    unread = f" ({step.unparsed} answered but unreadable to the client)" if step.unparsed else ""
    reasons = f"; first reasons: {'; '.join(step.failure_reasons)}" if step.failure_reasons else ""
    return (f"step {step.rate:g} req/s: {step.answered} of {step.offered} answered ({step.achieved_rps:.2f} req/s),"
            f" {step.failed} failed{unread}, {step.output_tokens_per_s:,.1f} tok/s; vLLM's TTFT p99"
            f" {ms(step.engine_ttft_p99_s)}, ITL p99 {ms(step.engine_itl_p99_s)} (the client's: TTFT p99"
            f" {ms(step.ttft_p99_s)}, per-request mean ITL p99 {ms(step.itl_p99_s)}):"
            f" {'missed ' + '+'.join(missed) if missed else 'within the objective'}{reasons}")


def _metrics_urls(chosen: Chosen) -> list[str]:
    """Each benched replica's ``/metrics`` (its first node's API port)."""
    return [f"{replica.api_url}/metrics" for replica in chosen.replicas]


def _reading(urls: list[str]) -> Reading | None:
    try:
        return read(urls)
    except OSError:
        return None


def _with_engine_latency(step: Step, before: Reading | None, after: Reading | None) -> Step:
    """``step`` with vLLM's own p99s, p95s and means between two readings of its histograms (unchanged without both:
    the step then misses both latency limits)."""
    if before is None or after is None:
        return step
    p99 = quantile_between(0.99, before.buckets, after.buckets)
    p95 = quantile_between(0.95, before.buckets, after.buckets)
    mean = mean_between(before, after)
    return replace(step, engine_ttft_p99_s=p99["ttft"], engine_itl_p99_s=p99["itl"], engine_ttft_p95_s=p95["ttft"],
                   engine_itl_p95_s=p95["itl"], engine_ttft_mean_s=mean["ttft"], engine_itl_mean_s=mean["itl"])


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _engine_metrics(fleet: Fleet, chosen: Chosen, steps: list[Step]) -> tuple[list[Step], list[str]]:
    """``steps`` with vLLM's KV cache usage and preemptions from the first monitoring host's Prometheus, and a note
    when they could not be read."""
    hosts = group_hosts(fleet, MONITORING_GROUP)
    if not hosts or hosts[0] not in fleet.configs:
        return steps, ["KV cache usage and preemptions: no monitoring host"]
    url = prometheus_url(fleet, hosts[0])
    replica = chosen.replicas[0].name if chosen.key.scope == "replica" else None
    try:
        return with_engine_metrics(steps, url, chosen.model.name, replica), []
    except PrometheusError as exc:
        note = f"KV cache usage and preemptions: {exc} (prometheus_allowed_from must let this host in)"
        click.echo(f"gpufleet bench: {note}", err=True)
        return steps, [note]


def _store(inventory: str, data: tuple[str, ...], fleet: Fleet, record: Record, replicas: list[Replica]) -> list[str]:
    """Write ``record`` and the ceiling rules on every monitoring host; a line for each host it could not be written
    on."""
    from gpufleet.remote.bench_store import store_record  # pyinfra's SSH stack: loaded only when asked
    from gpufleet.remote.gpu_probe import load_inventory

    hosts = group_hosts(fleet, MONITORING_GROUP)
    if not hosts:
        return ["no monitoring group: the record is only printed (and in --report)"]
    return store_record(load_inventory(inventory, parse_data_args(list(data)) or None), hosts, record, replicas)


@click.command("bench")
@click.argument("inventory")
@click.option("--model", help="The served model name to measure (default: the fleet's only one).")
@click.option("--replica", help="Measure one replica on its own API instead of the model through its routers.")
@click.option("--slo", "slo_text", metavar="ttft_p99_s=S,itl_p99_s=S",
              help="The objective (default: the pool's vllm_slo_ttft_p99_s and vllm_slo_itl_p99_s).")
@click.option("--rates", "rates_text", metavar="R1,R2,..",
              help="Requests per second of each step, increasing (default: doubling from 0.5, then refined).")
@click.option("--dataset", type=click.Path(dir_okay=False, path_type=Path),
              help="JSONL requests: {\"prompt\": ..., \"output_tokens\": N} (default: random lengths from"
                   " max_model_len).")
@click.option("--step-s", type=Number(5, 3600, what="a number of seconds"), default=DEFAULT_STEP_S, show_default=True,
              help="Seconds each step sends requests (at least 10 TTFT objectives).")
@click.option("--client", "client_name", help="The router client whose key the bench uses (default: the first"
                                              " allowed the model).")
@click.option("--ca-file",
              help="CA of the routers' certificate (default: the inventory's router_tls_ca, else the system's).")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), help="Also write the record here (JSON).")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="Draw latency against rate, objective and ceiling marked (SVG).")
@click.option("--no-store", is_flag=True, help="Do not write the record on the monitoring hosts.")
@DATA_OPTION
def bench_command(inventory: str, model: str | None, replica: str | None, slo_text: str | None,
                  rates_text: str | None, dataset: Path | None, step_s: float, client_name: str | None,
                  ca_file: str | None, report: Path | None, plot: Path | None, no_store: bool,
                  data: tuple[str, ...]) -> None:
    """Measure a model's serving ceiling: the highest request rate the replicas sustain, answering at least 95% of
    it within each step with no failed request, while vLLM's p99 TTFT and ITL over the step meet the objective. The
    client (guidellm) runs here, on the controller."""
    fleet = cli_fleet(inventory, data)
    plan = plan_fleet(fleet, fleet_facts(fleet, None))
    if plan.problems:
        fail_lines([problem.line() for problem in plan.problems])
    chosen = _choose(plan, model, replica)
    default_slo = Slo(chosen.model.ttft_p99_s, chosen.model.itl_p99_s)
    try:
        slo = parse_slo(slo_text, default_slo) if slo_text is not None else default_slo
    except RampError as exc:
        fail_lines([f"gpufleet bench: --slo: {exc}"])
    try:
        rates = parse_rates(rates_text) if rates_text is not None else None
    except RampError as exc:
        fail_lines([f"gpufleet bench: --rates: {exc}"])
    if problem := step_problem(step_s, slo):
        fail_lines([f"gpufleet bench: --step-s: {problem}"])
    if ca_file is not None and (problem := ca_problem(ca_file)):
        fail_lines([f"gpufleet bench: --ca-file: {problem}"])
    for option, path in (("--report", report), ("--plot", plot)):
        if path is not None and (problem := output_file_problem(path)):
            fail_lines([f"gpufleet bench: {option}: {problem}"])
    if report is not None and plot is not None and report.resolve() == plot.resolve():
        fail_lines([f"gpufleet bench: --plot: expected another file than --report's, found the same {str(plot)!r}"])
    if rates is not None and (few := next((r for r in rates if r * step_s < 1), None)):
        fail_lines([f"gpufleet bench: --rates: expected rates whose step of {step_s:g} s sends a request or more,"
                    f" found {few:g}"])
    max_len = min(r.max_model_len for r in chosen.replicas)
    try:
        rows = load_dataset(dataset, max_len) if dataset is not None else None
    except DatasetError as exc:
        fail_lines([f"gpufleet bench: --dataset: {exc}"])
    if rows is not None and rates is not None and (need := client.step_requests(max(rates), step_s)) > len(rows):
        fail_lines([f"gpufleet bench: --dataset: {dataset}: expected at least {need:,} requests (each is sent once;"
                    f" the step of {max(rates):g} req/s over {step_s:g} s sends {need:,}), found {len(rows):,}"])
    _not_on_a_serving_node(fleet)
    target = _target(fleet, chosen, client_name, ca_file, rates)
    steps_max = len(rates) if rates is not None else MAX_DOUBLINGS + REFINE_STEPS
    click.echo(f"gpufleet bench: {chosen.key.line()}, {len(chosen.replicas)} replica(s) at {target.base_url};"
               f" objective TTFT p99 {slo.ttft_p99_s:g} s, ITL p99 {slo.itl_p99_s:g} s; at most {steps_max} steps"
               f" of {step_s:g} s (each bounded to {client.step_bound_s(step_s):g} s)")
    try:
        exe = client.client_path(lambda line: click.echo(f"gpufleet bench: {line}"))
    except client.ClientError as exc:
        fail_lines([f"gpufleet bench: {exc}"])
    steps: list[Step] = []
    metrics = _metrics_urls(chosen)
    try:
        read(metrics)
    except OSError as exc:
        fail_lines([f"gpufleet bench: vLLM's /metrics could not be read ({exc}): each step is judged on vLLM's own"
                    " latency histograms (vllm_api_allowed_from must let this host in)"])
    if not settled(lambda: _reading(metrics)):
        click.echo(f"gpufleet bench: the replicas did not settle within {DRAINED_WITHIN_S:g} s (requests in their"
                   " engines, or /metrics answered late): another load shares them, and the first step measures"
                   " beside it")
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-data-") as tmp:
        workload = (client.Workload(dataset=write_for_client(rows, Path(tmp) / "requests.jsonl"))
                    if rows is not None else client.workload_for(max_len))
        while (rate := next_rate(steps, slo, rates)) is not None:
            if rows is not None and client.step_requests(rate, step_s) > len(rows):
                click.echo(f"gpufleet bench: the ramp ends before {rate:g} req/s: its step would send"
                           f" {client.step_requests(rate, step_s):,} requests, the dataset holds {len(rows):,}")
                break
            before = _reading(metrics)
            watch = (MissWatch(lambda: _reading(metrics), before, slo.ttft_p99_s, client.step_requests(rate, step_s))
                     if before is not None else None)
            try:
                step = client.run_step(exe, target, workload, rate, step_s, watch)
            except client.ClientError as exc:
                fail_lines([f"gpufleet bench: step {rate:g} req/s: {exc}"])
            except client.StoppedEarly as stopped:
                assert watch is not None
                if not settled(watch.read):  # the next step must not inherit this one's backlog
                    click.echo(f"gpufleet bench: step {rate:g} req/s: the replicas had not settled"
                               f" {DRAINED_WITHIN_S:g} s after it was stopped")
                step = stopped_step(rate, watch, stopped.reason, stopped.ended_at)
            after = _reading(metrics)
            step = _with_engine_latency(step, before, after)
            steps.append(step)
            click.echo(_progress(step, slo))
    steps, notes = _engine_metrics(fleet, chosen, steps)
    for step in steps if not notes else []:
        click.echo(f"vLLM at {step.rate:g} req/s: KV cache usage up to {_share(step.kv_usage_max)},"
                   f" {_count(step.preemptions)} preemptions, up to {_count(step.running_max)} requests running at"
                   " once on a replica")
    shape = ({"dataset": str(dataset), "requests": len(rows)} if rows is not None else
             {"prompt_tokens": list(workload.prompt_tokens), "output_tokens": list(workload.output_tokens)})
    record = Record(chosen.key, len(chosen.replicas), slo, sorted(steps, key=lambda s: s.rate), shape,
                    f"guidellm {client.VERSION}", datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    step_s, notes)
    found = record.ceiling
    if found.rate is None:
        click.echo(f"ceiling: none: the first step ({steps[0].rate:g} req/s) missed {found.stopped_by}")
    else:
        per = record.per_replica_rps() or 0.0
        bound = "at least " if found.stopped_by == "none" else ""
        why = "no step missed: rerun with higher --rates" if found.stopped_by == "none" else (
            f"stopped by {found.stopped_by}")
        click.echo(f"ceiling: {bound}{found.rate:.3g} req/s answered at {found.offered:g} offered ({per:.3g} per"
                   f" replica), {why}")
    text = json.dumps(record.to_json(), sort_keys=True)
    if report is not None:
        report.write_text(json.dumps(record.to_json(), indent=2, sort_keys=True) + "\n")
    if plot is not None:
        plot.write_text(render_svg(record))
    if not no_store:
        for line in _store(inventory, data, fleet, record, plan.replicas):
            click.echo(f"gpufleet bench: {line}", err=True)
        click.echo(f"record: {RECORDS_DIR}/{chosen.key.file_name()} on the monitoring hosts ({len(text):,} bytes)")
