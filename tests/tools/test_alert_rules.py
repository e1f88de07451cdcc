"""gpufleet's Prometheus rules (``templates/monitoring/rules/``, :mod:`gpufleet.monitoring.alert_rules`) under promtool.

The rules are rendered as a deploy renders them, from a host's configuration (every role's defaults), and must pass
``promtool check rules``. ``tests/data/alert_rules/`` holds promtool's unit tests as data:

- ``gpu.test.yml``, ``serving.test.yml``, ``node.test.yml``: series that fire each alert within its ``for``, and
  beside them series just short of it; ``healthy.test.yml``: a busy, healthy fleet that fires nothing;
- ``annotations.test.yml``: the annotations Alertmanager receives. promtool compares annotations whole, so the other
  files run against the same rules without their annotations;
- ``changed.test.yml``: the rules rendered with ``changed.values.yml``, where other series fire;
- ``variables.yml``: each threshold variable, and the rules whose expression or ``for`` it must change.

Every alert needs a case that fires it and one where it must not fire. promtool comes with Debian's ``prometheus``
package (scripts/install-lab-deps.sh installs it); without it, these tests fail.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from gpufleet_lab.double_programs.dcgm_exporter import read_counters

from gpufleet.measure.capacity import ModelCapacity, ShapeCeiling
from gpufleet.measure.engine_metrics import queries
from gpufleet.monitoring import ceiling_rules
from gpufleet.monitoring.alert_rules import RULE_FILES, THRESHOLDS, render_rules
from gpufleet.rollout.latency import PrometheusLatency
from gpufleet.templates import render
from tests.conftest import DATA, host_tool
from tests.unit.configs import host_config

CASES = DATA / "alert_rules"
FIRING_FILES = ("gpu.test.yml", "serving.test.yml", "node.test.yml", "healthy.test.yml")
SEVERITIES = {"critical", "warning"}


def _rules(texts: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Every rule of the rendered files by its name (alert or record)."""
    found: dict[str, dict[str, Any]] = {}
    for text in texts.values():
        for group in yaml.safe_load(text)["groups"]:
            for rule in group["rules"]:
                name = rule.get("alert") or rule["record"]
                assert name not in found, f"{name} defined twice"
                found[name] = rule
    return found


def _alerts(texts: dict[str, str]) -> dict[str, dict[str, Any]]:
    return {name: rule for name, rule in _rules(texts).items() if "alert" in rule}


def _without_annotations(text: str) -> str:
    doc = yaml.safe_load(text)
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    return yaml.safe_dump(doc, sort_keys=False)


def _promtool_test(tmp_path: Path, texts: dict[str, str], case: str, annotations: bool = False) -> None:
    """Run ``tests/data/alert_rules/<case>`` with promtool beside the rules (``rule_files`` are relative to it)."""
    for name, text in texts.items():
        (tmp_path / name).write_text(text if annotations else _without_annotations(text))
    shutil.copy(CASES / case, tmp_path / case)
    promtool = host_tool("promtool", "prometheus")
    done = subprocess.run([promtool, "test", "rules", case], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def default_rules() -> dict[str, str]:
    return render_rules(host_config())


def _changed_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CASES / "changed.values.yml").read_text())
    return values


# --- promtool ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("values", [
    {},
    _changed_values(),
    {"alert_gpu_critical_xids": [9999], "alert_gpu_thermal_throttle_ratio": 1e-9, "alert_kv_cache_usage_max": 0.999999,
     "alert_engine_stall_s": 86400,
     "alert_engine_stall_for_s": 0, "alert_serving_for_s": 0,
     "alert_replica_down_for_s": 0, "alert_unit_restarts_max": 0, "alert_prefix_hit_ratio_drop": 1e-9},
], ids=["defaults", "changed", "extremes"])
def test_rules_pass_promtool_check(tmp_path: Path, values: dict[str, Any]) -> None:
    texts = render_rules(host_config(**values))
    assert sorted(texts) == sorted(RULE_FILES)
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    promtool = host_tool("promtool", "prometheus")
    done = subprocess.run([promtool, "check", "rules", *RULE_FILES], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("case", FIRING_FILES)
def test_promtool_cases(tmp_path: Path, default_rules: dict[str, str], case: str) -> None:
    _promtool_test(tmp_path, default_rules, case)


def test_annotations_as_alertmanager_gets_them(tmp_path: Path, default_rules: dict[str, str]) -> None:
    _promtool_test(tmp_path, default_rules, "annotations.test.yml", annotations=True)


def test_changed_thresholds_change_what_fires(tmp_path: Path) -> None:
    _promtool_test(tmp_path, render_rules(host_config(**_changed_values())), "changed.test.yml")


# --- what the cases cover ---------------------------------------------------------------------------------------

def _alert_cases() -> tuple[set[str], set[str]]:
    """Alerts some case expects to fire, and alerts some case expects not to fire (default thresholds)."""
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in FIRING_FILES:
        for group in yaml.safe_load((CASES / case).read_text())["tests"]:
            for check in group.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    return firing, quiet


def test_every_alert_has_a_case_that_fires_it_and_one_that_must_not(default_rules: dict[str, str]) -> None:
    alerts = set(_alerts(default_rules))
    firing, quiet = _alert_cases()
    assert sorted(alerts - firing) == [], "alerts no case fires"
    assert sorted(alerts - quiet) == [], "alerts no case expects to stay quiet"
    assert sorted((firing | quiet) - alerts) == [], "cases of alerts the rules do not define"


def test_each_threshold_reaches_its_rules_and_no_other(default_rules: dict[str, str]) -> None:
    cases: dict[str, dict[str, Any]] = yaml.safe_load((CASES / "variables.yml").read_text())
    assert sorted(cases) == sorted(THRESHOLDS)
    before = _rules(default_rules)
    for variable, case in cases.items():
        after = _rules(render_rules(host_config(**{variable: case["value"]})))
        changed = {name for name, rule in after.items()
                   if (rule["expr"], rule.get("for")) != (before[name]["expr"], before[name].get("for"))}
        assert sorted(changed) == sorted(case["rules"]), variable


# --- what every rule carries ------------------------------------------------------------------------------------

def test_every_alert_has_a_severity_a_summary_a_description_and_a_runbook(default_rules: dict[str, str]) -> None:
    for name, rule in _alerts(default_rules).items():
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert set(rule["annotations"]) == {"summary", "description", "runbook"}, name
        assert all(text.strip() for text in rule["annotations"].values()), name
        assert len(rule["annotations"]["summary"]) < len(rule["annotations"]["description"]), name


def test_every_recording_rule_is_explained_by_a_comment(default_rules: dict[str, str]) -> None:
    for name, text in default_rules.items():
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.lstrip().startswith("- record:"):
                assert lines[i - 1].lstrip().startswith("#"), f"{name}: {line.strip()} has no comment above it"


def test_rule_files_name_the_plan_figures_they_read(default_rules: dict[str, str]) -> None:
    read = set(re.findall(r"gpufleet:\w+", "".join(str(rule["expr"]) for rule in _rules(default_rules).values())))
    assert read == {"gpufleet:node_gpus_expected", "gpufleet:model_replicas_min", "gpufleet:replica_ranks_expected",
                    "gpufleet:model_prefix_routed", "gpufleet:model_slo_ttft_p99_seconds",
                    "gpufleet:model_slo_itl_p99_seconds", "gpufleet:model_ceiling_rps", "gpufleet:replica_shape",
                    "gpufleet:replica_ceiling_rps", "gpufleet:replica_gpu_hour_cost"}
    for text in default_rules.values():
        header = text.split("\ngroups:", 1)[0]
        assert all(fact + "{" in header for fact in read)


def test_the_dcgm_fields_the_rules_read_are_turned_on(default_rules: dict[str, str], tmp_path: Path) -> None:
    """Every DCGM field an alert reads is in gpufleet's counters file (templates/dcgm_exporter/counters.csv.j2)."""
    counters = tmp_path / "counters.csv"
    counters.write_text(render("dcgm_exporter/counters.csv.j2", nvlink=True))
    exported = {field for field, _, _ in read_counters(str(counters))}
    read = set(re.findall(r"\bDCGM_\w+", "".join(str(rule["expr"]) for rule in _rules(default_rules).values())))
    assert read and sorted(read - exported) == []


def test_the_ceiling_file_gpufleet_bench_writes_feeds_the_capacity_alert(tmp_path: Path,
                                                                       default_rules: dict[str, str]) -> None:
    """The ceilings of tests/data/alert_rules/ceilings.test.yml's models, one replica of each shape measured."""
    two = (ShapeCeiling("tp1-pp1", "8xH100-SXM", 2.0, 2),)
    capacities = {model: ModelCapacity(model, "0.32.0", 2, 4.0, (), True, two)
                  for model in ("chat $HOME 100%", "drained", "lost")}
    capacities["mix"] = ModelCapacity("mix", "0.32.0", 3, 8.0, (), True,
                                      (ShapeCeiling("tp1-pp1", "lab-cpu", 3.0, 1),
                                       ShapeCeiling("tp1-pp2", "lab-cpu", 5.0, 1)))
    ceilings = ceiling_rules.ceiling_rules(capacities, "# the test's\n")
    _promtool_test(tmp_path, {**default_rules, "ceilings.yml": ceilings}, "ceilings.test.yml")
    promtool = host_tool("promtool", "prometheus")
    done = subprocess.run([promtool, "check", "rules", "ceilings.yml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_benchs_engine_queries_read_one_models_replicas_over_the_step(tmp_path: Path) -> None:
    """gpufleet bench's PromQL (gpufleet.measure.engine_metrics) under promtool: the highest KV cache usage, the
    preemptions and the most requests one replica ran at once (its two engines summed) of one model's replicas over a
    2-minute step (not another model's, not before the step), and of one replica with --replica; a hostile model name
    is quoted."""
    model = 'chat $HOME 100% "x"'
    labels = 'job="vllm", model="chat $HOME 100% \\"x\\"", replica="{replica}"'
    series = []
    for replica, kv, preempted in (("r0", "0.2x5 0.9 0.5x4", "0x5 0+2x5"), ("r1", "0.3x10", "0x10")):
        series += [{"series": "vllm:kv_cache_usage_perc{" + labels.format(replica=replica) + "}", "values": kv},
                   {"series": "vllm:num_preemptions_total{" + labels.format(replica=replica) + "}",
                    "values": preempted}]
    running = (("r0", "0", "1x10"), ("r0", "1", "0x8 5 0"), ("r1", "0", "2x4 40 2x5"))  # r0 at 9m: 1 + 5
    series += [{"series": "vllm:num_requests_running{" + labels.format(replica=replica) + f', engine="{engine}"' + "}",
                "values": values} for replica, engine, values in running]
    series += [{"series": 'vllm:kv_cache_usage_perc{job="vllm", model="other", replica="o0"}', "values": "1x10"},
               {"series": 'vllm:num_requests_running{job="vllm", model="other", replica="o0"}', "values": "99x10"}]
    whole, one = queries(model, None, 120), queries(model, "r1", 120)

    def case(expr: str, value: float) -> dict[str, Any]:
        return {"eval_time": "10m", "expr": expr, "exp_samples": [{"labels": "{}", "value": value}]}

    tests = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [case(whole["kv_usage_max"], 0.5), case(whole["preemptions"], 4),
                             case(one["kv_usage_max"], 0.3), case(one["preemptions"], 0),
                             case(whole["running_max"], 6), case(one["running_max"], 2)]}]}
    (tmp_path / "engine.test.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    promtool = host_tool("promtool", "prometheus")
    done = subprocess.run([promtool, "test", "rules", "engine.test.yml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_canarys_percentile_queries_read_only_the_replicas_named(tmp_path: Path) -> None:
    """A rollout's canary queries (gpufleet.rollout.latency.PrometheusLatency) under promtool: replica r1's requests
    and p95 and mean over the last 2 minutes, not r10's (the names are anchored) nor those of r.1 (a dot is no
    wildcard); the oldest last scrape of the replicas named, which the canary waits past before it reads them."""
    series = []
    for replica, per_minute_fast, per_minute_slow in (("r1", 10, 0), ("r10", 0, 10), ("rx1", 0, 10)):
        labels = f'job="vllm", model="m", replica="{replica}"'
        for le, count in (("0.1", per_minute_fast), ("1.0", per_minute_fast + per_minute_slow),
                          ("+Inf", per_minute_fast + per_minute_slow)):
            series.append({"series": f'vllm:time_to_first_token_seconds_bucket{{{labels}, le="{le}"}}',
                           "values": f"0+{count}x10"})
        series.append({"series": f"vllm:time_to_first_token_seconds_count{{{labels}}}",
                       "values": f"0+{per_minute_fast + per_minute_slow}x10"})
        # each fast first token takes 50 ms, each slow one 500 ms
        series.append({"series": f"vllm:time_to_first_token_seconds_sum{{{labels}}}",
                       "values": f"0+{per_minute_fast * 0.05 + per_minute_slow * 0.5}x10"})
    # r1 scraped each minute through the tenth, r10 last at the eighth: the oldest last scrape of the two is the
    # eighth minute's (a sample's time is when its scrape began)
    series += [{"series": 'up{job="vllm", replica="r1"}', "values": "1x10"},
               {"series": 'up{job="vllm", replica="r10"}', "values": "1x8"}]
    asked = PrometheusLatency.queries(["r1"], 120)
    dotted = PrometheusLatency.queries(["r.1"], 120)

    def case(expr: str, value: float | None) -> dict[str, Any]:
        samples = [{"labels": "{}", "value": value}] if value is not None else []
        return {"eval_time": "10m", "expr": expr, "exp_samples": samples}

    tests = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [case(asked["requests"], 20), case(asked["ttft"], 0.095), case(asked["ttft_mean"], 0.05),
                             case(dotted["requests"], None), case(PrometheusLatency.scraped_query(["r1"]), 600),
                             case(PrometheusLatency.scraped_query(["r1", "r10"]), 480),
                             case("vector(time())", 600)]}]}  # the clock the canary's wait reads the scrapes on
    (tmp_path / "canary.test.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    promtool = host_tool("promtool", "prometheus")
    done = subprocess.run([promtool, "test", "rules", "canary.test.yml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
