"""Runbooks beside the alerts: every alert gpufleet's rules raise links to its section of the guide's runbook page
(its ``runbook`` annotation), every section there is an alert's, and each names the findings of ``gpufleet diag``
that lead to it, every one a finding the catalog can give; every finding leads to some alert."""

from __future__ import annotations

import re

import pytest
import yaml

from gpufleet.diag.signatures import XID_RUNBOOK, catalog
from gpufleet.monitoring.alert_rules import RUNBOOK, render_rules
from tests.conftest import ROOT
from tests.unit.configs import host_config

ALERTS_HEADING = "## What each alert asks of you\n"
LEADS = re.compile(r"^Findings that lead here: (?P<list>.*)\.$", re.M)
LINKED = re.compile(r"\[`(?P<id>\w+)`\]\(#(?P<anchor>\w+)\)")


def _alerts() -> dict[str, dict[str, str]]:
    """Each alert of the rendered rules, by name: its annotations."""
    found = {}
    for text in render_rules(host_config()).values():
        for group in yaml.safe_load(text)["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    found[rule["alert"]] = rule["annotations"]
    return found


def _sections() -> dict[str, str]:
    """The runbook page's alert sections, by heading: from the alerts' heading to the next heading of its level."""
    text = (ROOT / RUNBOOK).read_text()
    assert ALERTS_HEADING in text
    part = re.split(r"^## ", text.split(ALERTS_HEADING, 1)[1], maxsplit=1, flags=re.M)[0]
    heads = re.split(r"^### (\S+)\n", part, flags=re.M)
    return dict(zip(heads[1::2], heads[2::2], strict=True))


def test_every_alert_links_to_its_section_and_every_section_is_an_alerts() -> None:
    alerts, sections = _alerts(), _sections()
    assert len(alerts) > 30
    assert set(sections) == set(alerts)
    for name, given in alerts.items():
        assert given.get("runbook") == f"{RUNBOOK}#{name.lower()}", (name, given)


@pytest.mark.parametrize("name", sorted(_sections()))
def test_each_section_names_the_findings_that_lead_to_it(name: str) -> None:
    section = _sections()[name]
    (leads,) = [m["list"] for m in LEADS.finditer(section)]  # one line, naming them or none
    ids = {s.id for s in catalog()} | {XID_RUNBOOK}
    named = [(m["id"], m["anchor"]) for m in LINKED.finditer(leads)]
    assert (leads == "none") == (named == []), leads
    assert all(found in ids and anchor == found for found, anchor in named), (named, sorted(ids))


def test_every_finding_leads_to_some_alert() -> None:
    led = {m["id"] for section in _sections().values() for leads in LEADS.findall(section)
           for m in LINKED.finditer(leads)}
    assert {s.id for s in catalog()} | {XID_RUNBOOK} <= led
