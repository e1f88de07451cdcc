"""gpufleet's Grafana dashboards (``templates/monitoring/dashboards/``, :mod:`gpufleet.monitoring.dashboards`).

Every dashboard is Grafana JSON that imports anywhere (a Prometheus datasource variable, no ``__inputs``), with unique
panel ids and a query in every panel. Every query must parse and return data: all of them, filled in with
``tests/data/dashboards/series.yml``'s ``variables``, run in one ``promtool test rules`` against that file's series
(like the lab's) beside gpufleet's rules, each as ``count((QUERY) == (QUERY)) > bool 0`` expecting 1, so that a query
that does not parse, returns nothing or only NaN fails its own test. ``tests/data/dashboards/must_fail.yml`` holds
queries that must fail the same check. promtool comes with Debian's ``prometheus`` package (tests/conftest.py's
policy when it is missing).
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from gpufleet_lab.double_programs.dcgm_exporter import read_counters

from gpufleet.monitoring import ceiling_rules
from gpufleet.monitoring import dashboards as dash
from gpufleet.monitoring.alert_rules import RULE_FILES, render_rules
from gpufleet.templates import render
from tests.conftest import DATA, host_tool
from tests.unit.configs import host_config

CASES = DATA / "dashboards"
EXPECTED_VARIABLES = {"gpufleet-fleet.json": [], "gpufleet-model.json": ["model"], "gpufleet-node-gpus.json": ["node"]}
"""Every dashboard shipped, and its variables besides the datasource."""
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
PLAN_FIGURES = {"gpufleet:node_gpus_expected", "gpufleet:model_replicas_min", "gpufleet:replica_ranks_expected",
                "gpufleet:replica_gpu_hour_cost",
                ceiling_rules.RECORD}  # the last from gpufleet bench (gpufleet.monitoring.ceiling_rules)


def _series() -> dict[str, Any]:
    series: dict[str, Any] = yaml.safe_load((CASES / "series.yml").read_text())
    return series


def _must_fail() -> list[dict[str, str]]:
    cases: list[dict[str, str]] = yaml.safe_load((CASES / "must_fail.yml").read_text())
    return cases


def _queries() -> list[dash.Query]:
    """Every query of the shipped dashboards, panels' and variables' ([] when a file does not load: the JSON tests
    below say why)."""
    try:
        return dash.panel_queries() + dash.variable_queries()
    except (ValueError, KeyError, AttributeError, TypeError):
        return []


QUERIES = _queries()


# --- the files -----------------------------------------------------------------------------------------------------

def test_the_dashboards_shipped() -> None:
    assert [path.name for path in dash.dashboard_files()] == sorted(EXPECTED_VARIABLES)


def _every_panel(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows and the panels inside them included."""
    found = []
    for panel in dashboard.get("panels", []):
        found += [panel, *panel.get("panels", [])]
    return found


@pytest.mark.parametrize("name", sorted(EXPECTED_VARIABLES))
def test_a_dashboard_is_grafana_json_that_imports_anywhere(name: str) -> None:
    dashboard = json.loads((dash.DASHBOARDS_DIR / name).read_text(encoding="utf-8"))
    assert dashboard["uid"] == name.removesuffix(".json") and dashboard["title"].startswith("gpufleet / ")
    assert "gpufleet" in dashboard["tags"] and isinstance(dashboard["schemaVersion"], int)
    assert "__inputs" not in dashboard and dashboard.get("id") is None  # provisioning takes neither

    variables = {variable["name"]: variable for variable in dash.template_variables(dashboard)}
    source = variables.pop(dash.DATASOURCE_VARIABLE)
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    assert sorted(variables) == EXPECTED_VARIABLES[name]
    for variable in variables.values():
        assert variable["type"] == "query" and variable["datasource"] == DATASOURCE, variable["name"]
        assert not variable["multi"] and not variable["includeAll"], variable["name"]  # exact matches: one value

    ids = [panel["id"] for panel in _every_panel(dashboard)]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids)), ids
    titles = [panel["title"] for panel in dash.panels(dashboard)]
    assert all(titles) and len(titles) == len(set(titles)), titles
    for panel in dash.panels(dashboard):
        where = f"{name}: {panel['title']}"
        grid = panel["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24, where
        assert panel["datasource"] == DATASOURCE, where
        targets = panel.get("targets", [])
        assert targets, f"{where}: no query"
        assert len({t["refId"] for t in targets}) == len(targets), where
        for target in targets:
            assert target["datasource"] == DATASOURCE and target["expr"].strip(), f"{where} ({target['refId']})"


def test_dashboard_uids_are_unique() -> None:
    uids = [dashboard["uid"] for dashboard in dash.load_dashboards().values()]
    assert len(uids) == len(set(uids)), uids


def test_queries_use_only_their_dashboards_variables_as_exact_label_values() -> None:
    dashboards = dash.load_dashboards()
    assert QUERIES
    for query in QUERIES:
        own = {v["name"] for v in dash.template_variables(dashboards[query.dashboard])}
        assert query.variables() <= own | set(dash.GRAFANA_BUILTINS), query.name
        for variable in query.variables() - set(dash.GRAFANA_BUILTINS):
            assert query.expr.count(f'="${variable}"') == query.expr.count(f"${variable}"), query.name
    assert len({query.name for query in QUERIES}) == len(QUERIES)


@pytest.fixture(scope="module")
def rules() -> dict[str, str]:
    return render_rules(host_config())


def test_the_dashboards_read_every_recording_rule_and_only_rules_that_exist(rules: dict[str, str]) -> None:
    recorded = {rule["record"] for group in yaml.safe_load(rules["recording.yml"])["groups"]
                for rule in group["rules"] if "record" in rule}
    read = {name for query in QUERIES for name in re.findall(r"\b[a-z_]+:[\w:]+", query.expr)
            if not name.startswith("vllm:")}
    assert sorted(recorded - read) == [], "recording rules no dashboard reads"
    assert sorted(read - recorded - PLAN_FIGURES) == [], "rules the dashboards read that nothing records"


def test_the_dcgm_fields_the_dashboards_read_are_turned_on(tmp_path: Path) -> None:
    counters = tmp_path / "counters.csv"
    counters.write_text(render("dcgm_exporter/counters.csv.j2", nvlink=True))
    exported = {field for field, _, _ in read_counters(str(counters))}
    read = {field for query in QUERIES for field in re.findall(r"\bDCGM_\w+", query.expr)}
    assert read and sorted(read - exported) == []


# --- the module ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("expr", "values", "expected"), [
    ('up{model="$model"}', {"model": "tiny llama $HOME 100%"}, 'up{model="tiny llama $HOME 100%"}'),
    ('rate(up{node="${node}"}[$__rate_interval])', {"node": "n1", "__rate_interval": "1m"}, 'rate(up{node="n1"}[1m])'),
    ('up{model="$model"}', {"model": 'a "b" \\ c'}, 'up{model="a \\"b\\" \\\\ c"}'),
    ('up{a="$node", b="$nodes"}', {"node": "x", "nodes": "y"}, 'up{a="x", b="y"}'),
    ('up{a=~"^b$"}', {}, 'up{a=~"^b$"}'),
])
def test_substitute(expr: str, values: dict[str, str], expected: str) -> None:
    assert dash.substitute(expr, values) == expected


def test_substitute_names_every_variable_without_a_value() -> None:
    with pytest.raises(ValueError, match=r"no value for \$model, \$node in"):
        dash.substitute('up{node="$node", model="${model}"}', {"other": "x"})


def test_resolve_fills_in_grafanas_own_variables() -> None:
    query = dash.Query("d.json", "t", "A", 'rate(up{model="$model"}[$__rate_interval])')
    assert query.resolve({"model": "m"}) == 'rate(up{model="m"}[1m])'
    assert query.resolve({"model": "m", "__rate_interval": "2m"}) == 'rate(up{model="m"}[2m])'
    assert query.name == "d.json: t (A)" and query.variables() == {"model", "__rate_interval"}


@pytest.mark.parametrize(("query", "expected"), [
    ('label_values(up{job="vllm"}, model)', 'group by (model) (up{job="vllm"})'),
    (' label_values( up{job="dcgm", a=","} ,node ) ', 'group by (node) (up{job="dcgm", a=","})'),
    ("query_result(max by (node) (up))", "max by (node) (up)"),
])
def test_variable_query(query: str, expected: str) -> None:
    assert dash.variable_query(query) == expected


@pytest.mark.parametrize("query", ["label_values(model)", "metrics(vllm:.*)", ""])
def test_variable_query_refuses_what_it_cannot_turn_into_promql(query: str) -> None:
    with pytest.raises(ValueError, match="unsupported variable query"):
        dash.variable_query(query)


def test_panels_inside_rows_count_and_rows_do_not() -> None:
    board = {"panels": [{"type": "row", "id": 1, "panels": [{"type": "stat", "id": 2, "title": "in",
                                                             "targets": [{"refId": "A", "expr": "up"}]}]},
                        {"type": "timeseries", "id": 3, "title": "out", "targets": [{"refId": "B", "expr": "up"}]}]}
    assert [p["id"] for p in dash.panels(board)] == [2, 3]
    assert [q.name for q in dash.panel_queries({"x.json": board})] == ["x.json: in (A)", "x.json: out (B)"]


def test_load_dashboards_names_a_file_that_is_not_json(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "b.json").write_text('{"panels": [}')
    with pytest.raises(ValueError, match=r"^b\.json: not JSON"):
        dash.load_dashboards(tmp_path)


def test_the_provider_file_points_grafana_at_the_dashboards() -> None:
    text = dash.provider_yaml()
    assert text.startswith("# ")
    doc = yaml.safe_load(text)
    assert doc["apiVersion"] == 1
    (provider,) = doc["providers"]
    assert (provider["type"], provider["folder"], provider["allowUiUpdates"]) == ("file", dash.FOLDER, False)
    assert provider["options"]["path"] == dash.GRAFANA_DASHBOARDS_DIR == "/var/lib/grafana/dashboards/gpufleet"
    odd = "/srv/grafana dash/'x' \"y\": #z"
    assert yaml.safe_load(dash.provider_yaml(odd, "a: b"))["providers"][0]["options"]["path"] == odd


@pytest.mark.parametrize(("path", "folder"), [("var/lib/grafana", "gpufleet"), ("", "gpufleet"),
                                              ("/a\nb", "gpufleet"), ("/a", " "), ("/a", "x\ny")])
def test_the_provider_file_refuses_a_bad_path_or_folder(path: str, folder: str) -> None:
    with pytest.raises(ValueError, match="expected"):
        dash.provider_yaml(path, folder)


def test_grafana_files_are_the_provider_and_the_dashboards_as_shipped() -> None:
    files = dash.grafana_files()
    assert files.pop("/etc/grafana/provisioning/dashboards/gpufleet.yaml") == dash.provider_yaml()
    assert files == {f"/var/lib/grafana/dashboards/gpufleet/{path.name}": path.read_text(encoding="utf-8")
                     for path in dash.dashboard_files()}


# --- every query parses and returns data (promtool) ----------------------------------------------------------------

@dataclass(frozen=True)
class Checked:
    """One promtool run over many queries, each keyed ``qN``: its output, and the failure of each key that failed."""

    returncode: int
    output: str
    failures: dict[str, str]

    def failure(self, key: str, what: str) -> str | None:
        """Why ``key`` failed (None when it passed); fails the test when promtool's run itself failed."""
        if self.returncode != 0 and not self.failures:
            pytest.fail(f"promtool failed before it checked {what}:\n{self.output}")
        return self.failures.get(key)


def _check(queries: dict[str, str], where: Path, rule_texts: dict[str, str]) -> Checked:
    """Run every query of ``queries`` (by key) in one promtool test against series.yml beside gpufleet's rules."""
    series = _series()
    for name, text in rule_texts.items():
        (where / name).write_text(text)
    checks = [{"expr": f"# {key}\ncount(({expr}) == ({expr})) > bool 0", "eval_time": series["eval_time"],
               "exp_samples": [{"labels": "{}", "value": 1}]} for key, expr in queries.items()]
    test = {"rule_files": list(RULE_FILES), "evaluation_interval": series["interval"],
            "tests": [{"interval": series["interval"], "input_series": series["input_series"],
                       "promql_expr_test": checks}]}
    (where / "dashboards.test.yml").write_text(yaml.safe_dump(test, sort_keys=False, width=1000))
    promtool = host_tool("promtool", "prometheus")
    done = subprocess.run([promtool, "test", "rules", "dashboards.test.yml"], cwd=where, capture_output=True,
                          text=True, timeout=120)
    output = done.stdout + done.stderr
    blocks = re.split(r"\n(?=\s*expr: )", output)
    failures = {m.group(1): block.strip() for block in blocks if (m := re.match(r'\s*expr: "# (q\d+)\\n', block))}
    return Checked(done.returncode, output, failures)


def _query_key(index: int) -> str:
    return f"q{index}"


def _must_fail_key(index: int) -> str:
    return f"q{len(QUERIES) + index}"


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory, rules: dict[str, str]) -> Checked:
    """Every dashboard query and every must-fail query, in one promtool run."""
    values = _series()["variables"]
    queries = {_query_key(i): query.resolve(values) for i, query in enumerate(QUERIES)}
    queries |= {_must_fail_key(i): dash.substitute(case["expr"], {**dash.GRAFANA_BUILTINS, **values})
                for i, case in enumerate(_must_fail())}
    return _check(queries, tmp_path_factory.mktemp("dashboards"), rules)


@pytest.mark.parametrize("index", range(len(QUERIES)), ids=[query.name for query in QUERIES])
def test_a_dashboard_query_parses_and_returns_data(checked: Checked, index: int) -> None:
    query = QUERIES[index]
    failure = checked.failure(_query_key(index), query.name)
    assert failure is None, f"{query.name}: {query.expr}\n{failure}"


@pytest.mark.parametrize("index", range(len(_must_fail())), ids=[case["reason"] for case in _must_fail()])
def test_the_check_refuses_a_query_that_fails(checked: Checked, index: int) -> None:
    case = _must_fail()[index]
    assert checked.failure(_must_fail_key(index), case["reason"]) is not None, case["expr"]
