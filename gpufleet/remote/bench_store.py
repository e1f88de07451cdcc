"""Bench records on the monitoring hosts (:data:`gpufleet.measure.records.RECORDS_DIR`), written and read over
pyinfra's connections as the inventory gives them."""

from __future__ import annotations

import json

from pyinfra.api.inventory import Inventory

from gpufleet.measure.capacity import model_capacities
from gpufleet.measure.records import RECORDS_DIR, Record, parse_records
from gpufleet.monitoring.ceiling_rules import CEILINGS_DIR, CEILINGS_FILE, ceiling_rules
from gpufleet.node_paths import PROMETHEUS_UNIT
from gpufleet.plan.planner import Replica
from gpufleet.remote.commands import PyinfraRemote, Remote, RemoteResult

HEADER = ("# Written by gpufleet bench from the bench records of this host (/var/lib/gpufleet/bench) and the plan\n"
          "# of the time (gpufleet.monitoring.ceiling_rules), checked with promtool: the capacity alert reads it.\n")

TIMEOUT_S = 60


def store_record(inventory: Inventory, hosts: list[str], record: Record, replicas: list[Replica]) -> list[str]:
    """Write ``record`` on each of ``hosts``, then each host's ceiling rules from its records and the plan's
    ``replicas``; a line for each host where either could not be."""
    remote = PyinfraRemote(inventory)
    path = f"{RECORDS_DIR}/{record.key.file_name()}"
    text = json.dumps(record.to_json(), sort_keys=True) + "\n"
    problems = []
    try:
        for host in hosts:
            written = _write(remote, host, RECORDS_DIR, path, text)
            if not written.ok:
                problems.append(f"{host}: the record was not written: {written.line()}")
                continue
            if problem := publish_ceilings(remote, host, replicas):
                problems.append(problem)
    finally:
        remote.close()
    return problems


def _write(remote: PyinfraRemote, host: str, directory: str, path: str, text: str) -> RemoteResult:
    """``text`` into ``path`` (mode 0644) in ``directory`` (made 0755 when missing)."""
    made = remote.run(host, ["install", "-d", "-m", "0755", directory], timeout_s=TIMEOUT_S)
    written = remote.put_text(host, path, text) if made.ok else made
    return remote.run(host, ["chmod", "0644", path], timeout_s=TIMEOUT_S) if written.ok else written


def _run(remote: Remote, host: str, words: list[str]) -> RemoteResult:
    return remote.run(host, words, timeout_s=TIMEOUT_S)


def publish_ceilings(remote: PyinfraRemote, host: str, replicas: list[Replica]) -> str | None:
    """Write ``host``'s ceiling rules from every record it holds, check them with promtool, put them in place and
    reload Prometheus; why not, or None."""
    listed = remote.run(host, ["grep", "-r", "-h", "-e", ".", RECORDS_DIR], timeout_s=TIMEOUT_S, ok_status=(0, 1))
    if not listed.ok:
        return f"{host}: its bench records could not be read: {listed.line()}"
    records, _ = parse_records(listed.stdout)
    text = ceiling_rules(model_capacities(replicas, records), HEADER)
    final = f"{CEILINGS_DIR}/{CEILINGS_FILE}"
    candidate = f"{final}.new"  # not *.yml: Prometheus reads it only once checked and moved
    result = _write(remote, host, CEILINGS_DIR, candidate, text)
    for words in (["promtool", "check", "rules", candidate], ["mv", "-f", candidate, final],
                  ["systemctl", "try-reload-or-restart", PROMETHEUS_UNIT]):
        if not result.ok:
            break
        result = _run(remote, host, words)
    return None if result.ok else f"{host}: the ceiling rules were not put in place: {result.line()}"


def read_records(inventory: Inventory, hosts: list[str]) -> tuple[list[Record], list[str]]:
    """Every record on the first of ``hosts`` that answers, and a line for each host or file that could not be
    read."""
    remote = PyinfraRemote(inventory)
    problems: list[str] = []
    try:
        for host in hosts:
            result = remote.run(host, ["grep", "-r", "-h", "-e", ".", RECORDS_DIR], timeout_s=TIMEOUT_S,
                                ok_status=(0, 1, 2))
            if not result.ok:
                problems.append(f"{host}: the bench records could not be read: {result.line()}")
                continue
            found, bad = parse_records(result.stdout)
            return found, problems + [f"{host}: {RECORDS_DIR}: {line}" for line in bad]
    finally:
        remote.close()
    return [], problems
