"""``gpufleet bench`` (gpufleet/measure/, gpufleet/cli/bench.py): the ramp and its ceiling as data
(tests/data/bench/ramps.yaml), guidellm's report as it writes it (a real 0.8.1 report of a lab replica), the
scenario a step runs, the refusals before any host is touched (tests/data/bench/options.yaml), and a whole ramp with
the client replaced by a replica whose latency grows with the rate."""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from gpufleet.cli import bench as cli_bench
from gpufleet.cli.inputs import fleet_facts
from gpufleet.cli.main import main
from gpufleet.config.settings.router import RouterClient
from gpufleet.inventory.load import load_fleet
from gpufleet.measure import guidellm_client as client
from gpufleet.measure.capacity import model_capacities, releases_without_bench
from gpufleet.measure.engine_histograms import Reading
from gpufleet.measure.plot import render_svg
from gpufleet.measure.ramp import Slo, Step, ceiling, next_rate, parse_rates
from gpufleet.measure.records import Record, RecordKey, latest, parse_records
from gpufleet.plan.planner import Replica, plan_fleet
from gpufleet.values.types import SecretRef
from tests.conftest import DATA
from tests.unit import tls_files

BENCH = DATA / "bench"
FLEET = str(DATA / "rollout_fleet" / "inventory.py")
RAMPS = yaml.safe_load((BENCH / "ramps.yaml").read_text())
OPTIONS = yaml.safe_load((BENCH / "options.yaml").read_text())


def _step(rate: float, ttft: float | None, itl: float | None, failed: int = 0, answered: int = 100) -> Step:
    """A step of 100 offered requests, ``answered`` of them (none when ``ttft`` is None), judged on vLLM's p99s
    ``ttft`` and ``itl``."""
    answered = answered if ttft is not None else 0
    return Step(rate=rate, achieved_rps=rate * answered / 100, ttft_p50_s=ttft, ttft_p99_s=ttft,
                itl_p50_s=itl, itl_p99_s=itl, e2e_p50_s=ttft, e2e_p99_s=ttft, output_tokens_per_s=10.0 * rate,
                succeeded=answered, failed=failed, seconds=20.0, offered=100, engine_ttft_p99_s=ttft,
                engine_itl_p99_s=itl)


@pytest.mark.parametrize("case", RAMPS, ids=[c["id"] for c in RAMPS])
def test_ramp_ceiling_and_next_step(case: dict[str, Any]) -> None:
    slo = Slo(*case["slo"])
    steps = [_step(*row) for row in case["steps"]]
    found = ceiling(steps, slo)
    assert (found.rate, found.stopped_by) == (case["ceiling"], case["stopped_by"])
    assert next_rate(steps, slo, None) == case["next"]


def test_given_rates_run_in_order_and_stop_at_the_first_miss() -> None:
    slo, rates = Slo(1.0, 0.2), parse_rates("1, 2.5,4")
    assert rates == [1.0, 2.5, 4.0]
    assert next_rate([], slo, rates) == 1.0
    assert next_rate([_step(1, 0.5, 0.1)], slo, rates) == 2.5
    assert next_rate([_step(1, 0.5, 0.1), _step(2.5, 2.0, 0.1)], slo, rates) is None
    assert next_rate([_step(r, 0.5, 0.1) for r in rates], slo, rates) is None


def test_a_guidellm_report_becomes_a_step() -> None:
    """A real report (guidellm 0.8.1, constant 2 req/s for 15 s against a lab replica, trimmed to what is read):
    20 answered, 10 still running at the step's stop; TTFT and ITL in ms become seconds. Two thirds answered is
    not sustained, whatever the latencies of those answered."""
    doc = json.loads((BENCH / "guidellm-0.8.1-constant-2.json").read_text())
    step = client.step_from_report(doc, 2.0, 30)
    assert (step.succeeded, step.failed, step.offered, step.seconds) == (20, 0, 30, 15.0)
    assert step.failure_reasons == ["10 x not answered within the step's bound"]
    assert step.ttft_p99_s == pytest.approx(1.3572068, rel=1e-6)
    assert step.itl_p50_s == pytest.approx(0.1214862, rel=1e-6)
    assert step.e2e_p99_s == pytest.approx(7.2316303, rel=1e-6)
    assert step.achieved_rps == pytest.approx(20 / 15)
    assert step.output_tokens_per_s > 0
    assert step.missed(Slo(2.0, 0.3)) == ["ttft", "itl", "unanswered"]  # vLLM's histograms not read: not judged
    judged = replace(step, engine_ttft_p99_s=1.0, engine_itl_p99_s=0.1)
    assert judged.missed(Slo(2.0, 0.3)) == ["unanswered"]


def test_a_report_of_no_benchmark_is_refused() -> None:
    with pytest.raises(client.ClientError, match="expected one benchmark"):
        client.step_from_report({"benchmarks": []}, 1.0, 1)


def test_a_step_is_bounded_in_requests_and_time_and_keeps_the_key_off_its_command_line(tmp_path: Path) -> None:
    target = client.Target("https://10.0.0.10:8080", "m x", "sk-secret", "/etc/ca.pem", "/models/m")
    spec = client.scenario(target, client.workload_for(256), 2.5, 20.0, tmp_path / "r.json")["spec"]
    assert spec["constraints"] == [{"kind": "max_requests", "count": 50},
                                   {"kind": "max_duration", "seconds": 20.0 + client.GRACE_S}]
    assert spec["profile"] == {"kind": "constant", "rate": [2.5]}
    assert spec["backend"]["api_key"] == "sk-secret" and spec["backend"]["verify"] is True
    data = spec["data"][0]
    assert data["prompt_tokens_max"] + data["output_tokens_max"] <= 256
    assert client.step_requests(0.01, 5.0) == 1


def test_random_lengths_follow_the_model_length() -> None:
    assert client.workload_for(256) == client.Workload((64, 16, 1, 128), (32, 8, 1, 64))
    big = client.workload_for(131072)
    assert big.prompt_tokens[0] == 1024 and big.output_tokens[0] == 256
    assert big.prompt_tokens[3] + big.output_tokens[3] <= 131072


@pytest.mark.parametrize("case", OPTIONS, ids=[c["id"] for c in OPTIONS])
def test_bad_options_get_one_line_and_exit_2_before_any_host(case: dict[str, Any], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client, "client_path", _never)
    monkeypatch.setattr(client, "run_step", _never)
    args = [arg.replace("{dir}", str(tmp_path)) for arg in case.get("args", [])]
    for name, text in case.get("files", {}).items():  # more files in the test's folder ("|fifo": a named pipe)
        if text == "|fifo":
            os.mkfifo(tmp_path / name)
        else:
            (tmp_path / name).write_text(text)
    for option, name, given in (("--dataset", "requests.jsonl", case.get("dataset")),
                                ("--ca-file", "ca.pem", case.get("ca_file"))):
        if given == "|fifo":  # a named pipe: refused, never opened (it would wait for a writer)
            os.mkfifo(tmp_path / name)
        elif given == "|private-key":  # a key made for the run, never kept in the repository
            (tmp_path / name).write_text(tls_files.pem("key"))
        elif given is not None:
            (tmp_path / name).write_text(given)
        if given is not None:
            args += [option, str(tmp_path / name)]
    result = CliRunner().invoke(main, ["bench", FLEET, *args], prog_name="gpufleet")
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [case["expect"].replace("{dir}", str(tmp_path))]


def _never(*args: object, **kwargs: object) -> Any:
    raise AssertionError("refused input must not reach the client")


class _Replica:
    """Stands in for guidellm against a replica whose p99 TTFT is 0.2 s up to 3 req/s and grows 1 s per req/s
    above; the steps it was asked for, in order."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    def run_step(self, exe: Path, target: client.Target, workload: client.Workload, rate: float,
                 step_s: float, watch: Callable[[], str | None] | None = None) -> Step:
        self.asked.append(rate)
        return _step(rate, 0.2 + max(0.0, rate - 3.0), 0.05)


def test_a_ramp_finds_the_ceiling_prints_a_line_per_step_and_keeps_the_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    replica, stored = _Replica(), []
    monkeypatch.setattr(client, "client_path", lambda say: Path("/usr/bin/false"))
    monkeypatch.setattr(client, "run_step", replica.run_step)
    monkeypatch.setattr(cli_bench, "_store",
                        lambda inventory, data, fleet, record, replicas: stored.append(record) or [])
    pages: list[list[str]] = []
    bounds = [round(0.05 * i, 2) for i in range(1, 61)] + [math.inf]
    first_tokens: list[float] = []

    def read(urls: list[str]) -> Reading:
        """vLLM's histograms as the replica leaves them: each reading after a step finds ten more first tokens, at
        the TTFT of the rate last asked (0.2 s up to 3 req/s, 1 s more per req/s above), and a hundred more tokens
        within 10 ms (0.4 s in all)."""
        pages.append(urls)
        if replica.asked:
            first_tokens.extend([0.2 + max(0.0, replica.asked[-1] - 3.0)] * 10)
        n = len(pages)
        ttft = {le: float(sum(v <= le for v in first_tokens)) for le in bounds}
        return Reading({"ttft": ttft, "itl": {0.01: 100.0 * n, math.inf: 100.0 * n}},
                       {"ttft": sum(first_tokens), "itl": 0.4 * n})

    monkeypatch.setattr(cli_bench, "read", read)
    report, plot = tmp_path / "record.json", tmp_path / "ramp.svg"
    result = CliRunner().invoke(main, ["bench", FLEET, "--slo", "ttft_p99_s=1", "--step-s", "10",
                                       "--report", str(report), "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    assert replica.asked == [0.5, 1.0, 2.0, 4.0, 3.0, 3.5, 3.75, 3.875]
    lines = result.output.splitlines()
    assert sum(line.startswith("step ") for line in lines) == 8
    assert "ceiling: 3.75 req/s answered at 3.75 offered (0.625 per replica), stopped by ttft" in lines
    doc = json.loads(report.read_text())
    assert (doc["ceiling_rps"], doc["stopped_by"], doc["scope"], doc["replicas"]) == (3.75, "ttft", "routers", 6)
    assert (doc["model"], doc["release"], doc["layout"], doc["gpu_profile"]) == (
        "llama-3.1-70b", "0.32.0", "tp4-pp1", "8xH100-SXM")
    assert doc["slo"] == {"ttft_p99_s": 1.0, "itl_p99_s": 0.1}
    assert [s["rate"] for s in doc["steps"]] == [0.5, 1.0, 2.0, 3.0, 3.5, 3.75, 3.875, 4.0]
    # every replica's /metrics: once first, twice settling before the first step, then before and after each step
    assert len(pages) == 19 and len(pages[0]) == 6
    judged = {s["rate"]: s["engine_ttft_p99_s"] for s in doc["steps"]}  # within the 50 ms bucket of vLLM's TTFT
    assert judged[3.75] == pytest.approx(0.9 + 0.05 * 0.99) and judged[3.875] == pytest.approx(1.05 + 0.05 * 0.99)
    assert all(s["engine_itl_p99_s"] == pytest.approx(0.0099) for s in doc["steps"])
    assert all(s["engine_itl_p95_s"] == pytest.approx(0.0095) for s in doc["steps"])
    assert all(s["engine_ttft_mean_s"] == pytest.approx(0.2 + max(0.0, s["rate"] - 3)) for s in doc["steps"])
    assert stored and Record.from_json(stored[0].to_json()) == stored[0]
    svg = plot.read_text()
    assert svg.startswith("<svg") and "ceiling 3.75" in svg and "objective 1 s" in svg


def test_an_automatic_ramp_ends_before_a_step_its_dataset_cannot_fill(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each request of a step is its own row: 25 rows fill the steps of 0.5, 1 and 2 req/s over 10 s (5, 10 and 20
    requests), not the 40 of 4 req/s; the ramp ends there and says why."""
    replica = _Replica()
    monkeypatch.setattr(client, "client_path", lambda say: Path("/usr/bin/false"))
    monkeypatch.setattr(client, "run_step", replica.run_step)
    readings: list[int] = []

    def read(urls: list[str]) -> Reading:
        """Ten more first tokens at 0.2 s and a hundred more tokens within 10 ms at each reading: every step meets
        its objective."""
        readings.append(len(readings) + 1)
        n = readings[-1]
        return Reading({"ttft": {0.25: 10.0 * n, math.inf: 10.0 * n}, "itl": {0.01: 100.0 * n, math.inf: 100.0 * n}},
                       {"ttft": 2.0 * n, "itl": 0.4 * n})

    monkeypatch.setattr(cli_bench, "read", read)
    rows = tmp_path / "requests.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(25)))
    result = CliRunner().invoke(main, ["bench", FLEET, "--slo", "ttft_p99_s=1", "--step-s", "10", "--dataset",
                                       str(rows), "--no-store"])
    assert replica.asked == [0.5, 1.0, 2.0], result.output
    assert ("gpufleet bench: the ramp ends before 4 req/s: its step would send 40 requests, the dataset holds 25"
            in result.output.splitlines()), result.output


def test_records_round_trip_and_the_newest_of_a_key_wins() -> None:
    key = RecordKey("m", "0.32.0", "tp1-pp1", "8xH100-SXM", "routers")
    old = Record(key, 2, Slo(1, 0.1), [_step(1, 0.5, 0.05), _step(2, 2.0, 0.05)], {}, "guidellm 0.8.1",
                 "2026-11-01T00:00:00+00:00", 20.0)
    new = Record(key, 2, Slo(1, 0.1), [_step(1, 0.5, 0.05)], {}, "guidellm 0.8.1", "2026-11-20T00:00:00+00:00", 20.0)
    text = "\n".join(json.dumps(r.to_json()) for r in (new, old)) + "\n{\"schema\": 9}\n\n"
    found, bad = parse_records(text)
    assert found == [new, old]
    assert bad == ["line 3: not a bench record (ValueError: expected a bench record of schema 2, found 9)"]
    assert latest(found) == {key: new}
    assert old.ceiling.rate == 1 and old.per_replica_rps() == 0.5
    assert key.file_name() != RecordKey("m", "0.33.0", "tp1-pp1", "8xH100-SXM", "routers").file_name()


def test_the_plot_marks_the_missed_steps() -> None:
    key = RecordKey("a <b> & c", "0.32.0", "tp1-pp1", "8xH100-SXM", "replica")
    record = Record(key, 1, Slo(1, 0.1), [_step(1, 0.5, 0.05), _step(2, 2.0, 0.05)], {}, "guidellm 0.8.1",
                    "2026-11-01T00:00:00+00:00", 20.0)
    svg = render_svg(record)
    assert "a &lt;b&gt; &amp; c" in svg
    assert svg.count('fill="red"/>') == 2  # the 2 req/s step on both panels
    assert "ceiling 1" in svg


def _client(path: Path, body: str) -> Path:
    """A stand-in for guidellm: a Python script run as the client is, its ``--scenario`` at hand as ``spec``."""
    path.write_text(f"#!{sys.executable}\nimport json, os, sys, subprocess, time\n"
                    "path = sys.argv[sys.argv.index('--scenario') + 1]\n"
                    "spec = json.load(open(path))['spec']\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


def test_the_scenario_file_is_private(tmp_path: Path) -> None:
    """The step's scenario holds the key: it is written 0600 and handed to guidellm by path only."""
    seen = tmp_path / "seen.json"
    exe = _client(tmp_path / "guidellm", f"""
        json.dump({{"mode": os.stat(path).st_mode & 0o777, "argv": sys.argv}}, open({str(seen)!r}, "w"))
        with open(spec["outputs"][0]["path"], "w") as out:
            out.write(open({str(BENCH / "guidellm-0.8.1-constant-2.json")!r}).read())
        """)
    target = client.Target("http://10.0.0.1:8000", "m", "sk-secret", None, "/models/m")
    step = client.run_step(exe, target, client.workload_for(256), 2.0, 15.0)
    assert step.succeeded == 20
    found = json.loads(seen.read_text())
    assert found["mode"] == 0o600
    assert not any("sk-secret" in word for word in found["argv"])


def test_a_watched_step_ends_the_client_and_what_it_started_once_its_watch_gives_a_reason(tmp_path: Path) -> None:
    """The client and its sending processes run in a session of their own: a watch's reason ends them all (the
    step says why, with the time it ended), where a watch that never gives one lets the client end by itself."""
    child = tmp_path / "child.pid"
    exe = _client(tmp_path / "guidellm", f"""
        sender = subprocess.Popen(["sleep", "300"])
        open({str(child)!r}, "w").write(str(sender.pid))
        time.sleep(300)
        """)
    asked: list[float] = []

    def watch() -> str | None:
        asked.append(time.monotonic())
        return "decided" if len(asked) >= 2 and child.exists() else None

    target = client.Target("http://10.0.0.1:8000", "m", None, None, "/models/m")
    started = time.time()
    with pytest.raises(client.StoppedEarly) as stopped:
        client.run_step(exe, target, client.workload_for(256), 2.0, 15.0, watch)
    assert stopped.value.reason == "decided" and started < stopped.value.ended_at <= time.time()
    assert asked[-1] - asked[0] >= client.WATCH_EVERY_S * 0.9 * (len(asked) - 1)
    sender = int(child.read_text())
    for _ in range(50):  # the sleep is reaped by init once its parent is gone
        if not Path(f"/proc/{sender}").exists() or "Z" in Path(f"/proc/{sender}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the client's sending process {sender} outlived the stop")
    quiet = _client(tmp_path / "quiet", f"""
        with open(spec["outputs"][0]["path"], "w") as out:
            out.write(open({str(BENCH / "guidellm-0.8.1-constant-2.json")!r}).read())
        """)
    assert client.run_step(quiet, target, client.workload_for(256), 2.0, 15.0, lambda: None).succeeded == 20


class _Overloaded:
    """A replica past its ceiling from 4 req/s: at 2 req/s each reading finds ten more first tokens at 0.2 s; at
    4 req/s, twenty-five at 5 s, and the client, asking its watch as guidellm's runner does, is stopped by it."""

    def __init__(self) -> None:
        self.asked: list[float] = []
        self.first_tokens: list[float] = []
        self.answered = 0.0
        self.reasons: list[str] = []

    def run_step(self, exe: Path, target: client.Target, workload: client.Workload, rate: float,
                 step_s: float, watch: Callable[[], str | None] | None = None) -> Step:
        self.asked.append(rate)
        assert watch is not None
        if rate < 4:  # ten more at 0.2 s: nothing late, and the client ends by itself
            assert watch() is None
            return _step(rate, 0.2, 0.05)
        while (reason := watch()) is None:
            assert len(self.first_tokens) < 500, "the watch never decided"
        raise client.StoppedEarly(reason, time.time())

    def read(self, urls: list[str]) -> Reading:
        if self.asked:
            late = self.asked[-1] >= 4
            self.first_tokens.extend([5.0 if late else 0.2] * (25 if late else 10))
            self.answered += 2.0
        ttft = {le: float(sum(v <= le for v in self.first_tokens)) for le in (0.25, 2.5, 10.0, math.inf)}
        tokens = 10 * self.answered  # each within 10 ms
        return Reading({"ttft": ttft, "itl": {0.01: tokens, math.inf: tokens}},
                       {"ttft": sum(self.first_tokens), "itl": 0.005 * tokens}, self.answered, tokens)


def test_a_step_certain_to_miss_its_ttft_objective_is_stopped_and_recorded_from_vllms_counts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--rates 2,4 over 100 s steps with a TTFT objective of 2 s: the 4 req/s step offers 400 requests; once more
    than 4 of them (1%) waited over 2.5 s (the bucket over 2 s) for a first token its p99 has missed, and it is
    stopped there. The step at 2 req/s never gets there: its client ends by itself."""
    replica = _Overloaded()
    monkeypatch.setattr(client, "client_path", lambda say: Path("/usr/bin/false"))
    monkeypatch.setattr(client, "run_step", replica.run_step)
    monkeypatch.setattr(cli_bench, "read", replica.read)
    report = tmp_path / "record.json"
    result = CliRunner().invoke(main, ["bench", FLEET, "--slo", "ttft_p99_s=2", "--step-s", "100", "--rates",
                                       "2,4", "--no-store", "--report", str(report)])
    assert result.exit_code == 0, result.output
    assert replica.asked == [2, 4]
    stopped = [line for line in result.output.splitlines() if line.startswith("step 4 req/s")]
    assert len(stopped) == 1 and "missed ttft+unanswered" in stopped[0], result.output
    assert ("stopped early: 25 of its 400 requests had waited over 2 s for a first token (25 answered late, 0 still"
            " waiting), more than 1%: its TTFT p99 missed whatever the rest did") in stopped[0], stopped[0]
    assert "ceiling: " in result.output and "stopped by ttft+unanswered" in result.output, result.output
    step = json.loads(report.read_text())["steps"][1]  # vLLM's counts from before the step to the deciding reading
    assert (step["offered"], step["succeeded"], step["failed"], step["ttft_p99_s"]) == (400, 2, 0, None), step
    assert step["engine_ttft_p99_s"] > 2.5 and step["started_at"] <= step["ended_at"], step


def _planned() -> list[Replica]:
    fleet = load_fleet(FLEET)
    return plan_fleet(fleet, fleet_facts(fleet, None)).replicas


def _record(release: str, scope: str, rates: list[float], replicas: int, date: str = "2026-11-20T00:00:00+00:00",
            layout: str = "tp4-pp1") -> Record:
    key = RecordKey("llama-3.1-70b", release, layout, "8xH100-SXM", scope)
    steps = [_step(r, 0.5, 0.05) for r in rates] + [_step(rates[-1] * 2, 5.0, 0.05)]
    return Record(key, replicas, Slo(2.0, 0.1), steps, {}, "guidellm 0.8.1", date, 60.0)


def test_a_routers_record_gives_the_model_its_rate_per_replica_times_its_replicas() -> None:
    replicas = _planned()  # six replicas of tp4-pp1 on vLLM 0.32.0
    found = model_capacities(replicas, [_record("0.32.0", "routers", [1, 2, 3], replicas=3)])
    cap = found["llama-3.1-70b"]
    assert (cap.ceiling_rps, cap.replicas, cap.release, cap.current) == (6.0, 6, "0.32.0", True)
    assert cap.replicas_for(10.0) == 10 and cap.replicas_for(6.0) == 6
    assert releases_without_bench(replicas, [_record("0.32.0", "routers", [1], replicas=3)]) == []


def test_without_a_routers_record_each_replica_takes_its_shapes_one_replica_ceiling() -> None:
    replicas = _planned()
    found = model_capacities(replicas, [_record("0.32.0", "replica", [0.5, 0.75], replicas=1),
                                                 _record("0.32.0", "replica", [9], replicas=1, layout="tp8-pp1")])
    assert found["llama-3.1-70b"].ceiling_rps == pytest.approx(4.5)


def test_a_release_without_a_record_falls_back_to_the_newest_earlier_one_and_is_named() -> None:
    replicas = _planned()
    records = [_record("0.30.0", "routers", [1], replicas=6), _record("0.31.0", "routers", [1, 2], replicas=6),
               _record("0.33.0", "routers", [4], replicas=6)]
    cap = model_capacities(replicas, records)["llama-3.1-70b"]
    assert (cap.release, cap.current, cap.ceiling_rps) == ("0.33.0", False, 4.0)
    assert model_capacities(replicas, records[:2])["llama-3.1-70b"].release == "0.31.0"
    assert releases_without_bench(replicas, records[:2]) == [
        '"llama-3.1-70b": vLLM 0.31.0 has a measured ceiling (2 req/s), its successor 0.32.0 none: run gpufleet'
        ' bench']
    assert model_capacities(replicas, []) == {}


def test_the_client_never_runs_on_a_serving_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet whose serving node gpu-a01 is this machine (127.0.0.1): refused before the client is touched."""
    monkeypatch.setattr(client, "client_path", _never)
    monkeypatch.setattr(client, "run_step", _never)
    result = CliRunner().invoke(main, ["bench", str(BENCH / "on_a_serving_node" / "inventory.py")],
                                prog_name="gpufleet")
    assert result.exit_code == 2, result.output
    assert result.output.startswith("gpufleet bench: this machine is the serving node gpu-a01.dc1.example.net"
                                    " (127.0.0.1): run the bench from the controller")
    assert cli_bench.local_addresses(["127.0.0.1", "192.0.2.1"]) == ["127.0.0.1"]


def test_an_answer_the_client_could_not_read_is_not_a_failure() -> None:
    """A real report (constant 16 req/s for 10 s against a lab replica, trimmed to what is read): one of the 160
    answers held a character Python's line reader breaks a line at, and guidellm could not parse the chunk: the
    replica answered, so the step counts it apart and passes."""
    doc = json.loads((BENCH / "guidellm-0.8.1-constant-16-unparsed.json").read_text())
    assert doc["benchmarks"][0]["metrics"]["request_totals"]["errored"] == 1
    step = replace(client.step_from_report(doc, 16.0, 160), engine_ttft_p99_s=0.5, engine_itl_p99_s=0.1)
    assert (step.succeeded, step.failed, step.unparsed, step.answered) == (159, 0, 1, 160)
    assert step.missed(Slo(2.0, 0.3)) == [] and step.failure_reasons == []
    other = json.loads(json.dumps(doc).replace("JSONDecodeError(", "ReadTimeout("))  # any other error is a failure
    failed = client.step_from_report(other, 16.0, 160)
    assert (failed.failed, failed.unparsed) == (1, 0)
    reason = "1 x ReadTimeout('Unterminated string starting at: line 1 column 140 (char 139)')"
    assert failed.failure_reasons == [reason]


def test_the_bench_trusts_the_inventorys_ca_for_the_routers(tmp_path: Path) -> None:
    """The README's ``gpufleet bench inventories/lab/inventory.py`` needs no --ca-file: the routers' TLS brings the CA
    clients
    trust (router_tls_ca); --ca-file still wins, and a replica reached on its own API needs none."""
    fleet = load_fleet(FLEET)
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n")
    tls = {"router_tls_certificate": SecretRef(file=str(ca)), "router_tls_key": SecretRef(file=str(ca)),
           "router_tls_ca": str(ca)}
    for host, cfg in list(fleet.configs.items()):
        fleet.configs[host] = cfg.model_copy(update=tls)
    plan = plan_fleet(fleet, fleet_facts(fleet, None))
    routed = cli_bench._target(fleet, cli_bench._choose(plan, None, None), None, None, None)
    assert routed.base_url.startswith("https://") and routed.ca_file == str(ca)
    other = cli_bench._target(fleet, cli_bench._choose(plan, None, None), None, "/etc/other.pem", None)
    assert other.ca_file == "/etc/other.pem"
    alone = cli_bench._target(fleet, cli_bench._choose(plan, None, plan.replicas[0].name), None, None, None)
    assert alone.base_url.startswith("http://") and alone.ca_file is None


def test_the_bench_takes_the_first_client_whose_limits_let_the_ramp_through(tmp_path: Path) -> None:
    """Clients limited below the ramp are passed over for the first that is not (their 429s would be measured as the
    ceiling); given rates within a rate limit let that client through; a concurrency limit never does."""
    keys = {name: tmp_path / f"{name}.key" for name in ("batch", "slow", "open")}
    for name, path in keys.items():
        path.write_text(f"{name}-key-0123456789abcdef\n")
    clients = {"batch": RouterClient(api_key=SecretRef(file=str(keys["batch"])), concurrent_requests=8),
               "slow": RouterClient(api_key=SecretRef(file=str(keys["slow"])), requests_per_s=20),
               "open": RouterClient(api_key=SecretRef(file=str(keys["open"])))}
    fleet = load_fleet(FLEET)
    for host, cfg in list(fleet.configs.items()):
        fleet.configs[host] = cfg.model_copy(update={"router_clients": clients})
    chosen = cli_bench._choose(plan_fleet(fleet, fleet_facts(fleet, None)), None, None)
    assert cli_bench._target(fleet, chosen, None, None, None).api_key == "open-key-0123456789abcdef"
    assert cli_bench._target(fleet, chosen, None, None, [1.0, 20.0]).api_key == "slow-key-0123456789abcdef"
    assert cli_bench._target(fleet, chosen, "slow", None, [1.0, 20.0]).api_key == "slow-key-0123456789abcdef"
