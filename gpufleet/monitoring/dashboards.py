"""gpufleet's Grafana dashboards (``templates/monitoring/dashboards/*.json``): the files, the PromQL they run, and
the provider file that makes Grafana load them.

The dashboards are plain JSON in Grafana's dashboard model, shipped as they are (no rendering). Each reads one
Prometheus through the datasource variable :data:`DATASOURCE_VARIABLE`, so a file imports into any Grafana; the
series they read are those gpufleet's scrape configuration (:mod:`gpufleet.monitoring.scrape_config`) and rules
(:mod:`gpufleet.monitoring.alert_rules`, :mod:`gpufleet.monitoring.plan_rules`) give. Their other variables are
single values used as exact label matches (``model="$model"``).

For a test against a real Prometheus, :func:`panel_queries` and :func:`variable_queries` list every query with its
dashboard and panel, and :meth:`Query.resolve` fills in Grafana's variables as Grafana would, from given values and
:data:`GRAFANA_BUILTINS`. Queries over requests (latencies, tokens, router answers) return data once requests
flowed within their window.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from gpufleet.templates import TEMPLATES_DIR

DASHBOARDS_DIR = TEMPLATES_DIR / "monitoring" / "dashboards"
DATASOURCE_VARIABLE = "datasource"
"""The name of every dashboard's Prometheus datasource variable; panels name their datasource ``${datasource}``."""

GRAFANA_PROVISIONING_DIR = "/etc/grafana/provisioning/dashboards"
PROVIDER_FILE = "gpufleet.yaml"
GRAFANA_DASHBOARDS_DIR = "/var/lib/grafana/dashboards/gpufleet"
FOLDER = "gpufleet"

GRAFANA_BUILTINS: dict[str, str] = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
    "__range_s": "3600",
}
"""What Grafana gives its own variables for a Prometheus scraped every 15 s (``$__rate_interval``: four scrape
intervals) over the last hour."""

_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?P<selector>.+?)\s*,\s*(?P<label>\w+)\s*\)\s*$", re.DOTALL)
_PROMQL_ESCAPES = str.maketrans({"\\": "\\\\", '"': '\\"'})


@dataclass(frozen=True)
class Query:
    """One PromQL query of a dashboard: a panel's target, or a template variable's."""

    dashboard: str  # the dashboard's file name, e.g. "gpufleet-model.json"
    title: str  # the panel's title, or "$name" for a template variable
    ref_id: str  # the target's refId ("" for a variable)
    expr: str  # PromQL, with Grafana's variables as written

    @property
    def name(self) -> str:
        """``dashboard: title (refId)``, for a report."""
        return f"{self.dashboard}: {self.title}" + (f" ({self.ref_id})" if self.ref_id else "")

    def variables(self) -> set[str]:
        """The variables the query uses (``$name`` or ``${name}``)."""
        return {braced or bare for braced, bare in _VARIABLE.findall(self.expr)}

    def resolve(self, values: Mapping[str, str]) -> str:
        """The query as Grafana sends it: :func:`substitute` with ``values`` over :data:`GRAFANA_BUILTINS`."""
        return substitute(self.expr, {**GRAFANA_BUILTINS, **values})


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """``expr`` with each ``$name`` and ``${name}`` replaced by ``values[name]``, escaped for the double-quoted PromQL
    string the dashboards put it in (a value is not read again for variables). Raises ValueError naming the
    variables ``values`` lacks."""
    missing = sorted({braced or bare for braced, bare in _VARIABLE.findall(expr)} - set(values))
    if missing:
        raise ValueError(f"no value for {', '.join('$' + name for name in missing)} in {expr!r}")
    return _VARIABLE.sub(lambda m: values[m.group(1) or m.group(2)].translate(_PROMQL_ESCAPES), expr)


def dashboard_files(directory: Path = DASHBOARDS_DIR) -> list[Path]:
    """The dashboard files, by name."""
    return sorted(directory.glob("*.json"))


def load_dashboards(directory: Path = DASHBOARDS_DIR) -> dict[str, dict[str, Any]]:
    """Every dashboard by its file name. Raises ValueError naming a file that is not a JSON object."""
    found: dict[str, dict[str, Any]] = {}
    for path in dashboard_files(directory):
        try:
            dashboard = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path.name}: not JSON: {error}") from None
        if not isinstance(dashboard, dict):
            raise ValueError(f"{path.name}: expected a JSON object, found {type(dashboard).__name__}")
        found[path.name] = dashboard
    return found


def panels(dashboard: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The dashboard's panels, those inside rows included, rows left out."""
    found: list[dict[str, Any]] = []
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            found += [p for p in panel.get("panels", []) if p.get("type") != "row"]
        else:
            found.append(panel)
    return found


def template_variables(dashboard: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The dashboard's template variables (``templating.list``)."""
    variables: list[dict[str, Any]] = dashboard.get("templating", {}).get("list", [])
    return variables


def panel_queries(dashboards: Mapping[str, Mapping[str, Any]] | None = None) -> list[Query]:
    """Every panel target's query of ``dashboards`` (by file name; default: the shipped ones), in panel order."""
    dashboards = load_dashboards() if dashboards is None else dashboards
    return [Query(name, str(panel.get("title", "")), str(target.get("refId", "")), str(target.get("expr", "")))
            for name, dashboard in dashboards.items() for panel in panels(dashboard)
            for target in panel.get("targets", [])]


def variable_query(query: str) -> str:
    """The PromQL of a Prometheus query variable: ``label_values(SELECTOR, LABEL)`` is ``group by (LABEL)
    (SELECTOR)``, ``query_result(EXPR)`` is EXPR. Raises ValueError for another form."""
    if match := _LABEL_VALUES.match(query):
        return f"group by ({match['label']}) ({match['selector']})"
    stripped = query.strip()
    if stripped.startswith("query_result(") and stripped.endswith(")"):
        return stripped[len("query_result("):-1]
    raise ValueError(f"unsupported variable query {query!r}: expected label_values(SELECTOR, LABEL) or query_result")


def variable_queries(dashboards: Mapping[str, Mapping[str, Any]] | None = None) -> list[Query]:
    """The PromQL of every query variable (:func:`variable_query`), titled ``$name``."""
    dashboards = load_dashboards() if dashboards is None else dashboards
    found = []
    for name, dashboard in dashboards.items():
        for variable in template_variables(dashboard):
            if variable.get("type") != "query":
                continue
            query = variable.get("query")
            text = query.get("query", "") if isinstance(query, dict) else str(query or "")
            found.append(Query(name, f"${variable['name']}", "", variable_query(text)))
    return found


def provider_yaml(path: str = GRAFANA_DASHBOARDS_DIR, folder: str = FOLDER) -> str:
    """Grafana's dashboard provider file (for :data:`GRAFANA_PROVISIONING_DIR`): the dashboards in ``path`` (an
    absolute directory), shown in ``folder``, read-only in Grafana's UI. Raises ValueError for a relative ``path`` or
    an empty ``folder``."""
    if not PurePosixPath(path).is_absolute() or "\n" in path:
        raise ValueError(f"dashboards path: expected an absolute path, found {path!r}")
    if not folder.strip() or "\n" in folder:
        raise ValueError(f"dashboards folder: expected a folder name, found {folder!r}")
    provider = {
        "name": "gpufleet",
        "orgId": 1,
        "folder": folder,
        "type": "file",
        "disableDeletion": False,
        "allowUiUpdates": False,
        "updateIntervalSeconds": 60,
        "options": {"path": path, "foldersFromFilesStructure": False},
    }
    header = ("# Written by gpufleet: Grafana loads gpufleet's dashboards from the directory below. They are\n"
              "# read-only here: change them in gpufleet's repository (templates/monitoring/dashboards/).\n")
    return header + yaml.safe_dump({"apiVersion": 1, "providers": [provider]}, sort_keys=False, width=1000)


def grafana_files(path: str = GRAFANA_DASHBOARDS_DIR, folder: str = FOLDER,
                  directory: Path = DASHBOARDS_DIR) -> dict[str, str]:
    """What a Grafana host gets, by absolute path: the provider file, and each dashboard's text as shipped in
    ``path``."""
    files = {f"{GRAFANA_PROVISIONING_DIR}/{PROVIDER_FILE}": provider_yaml(path, folder)}
    files |= {f"{path.rstrip('/')}/{file.name}": file.read_text(encoding="utf-8")
              for file in dashboard_files(directory)}
    return files
