"""The failure-signature catalog (gpufleet/diag/signatures.py, gpufleet/data/failure_signatures.yml): the findings
it reads in a node's collected journals and kernel log (cases as data: tests/data/failure_signatures/), the catalog's
own rules, and its runbook sections (docs/guide/when-things-fail.md) kept in step with it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpufleet.diag.signatures import XID_RUNBOOK, CatalogError, catalog, parse_catalog, scan
from gpufleet.monitoring.alert_rules import RUNBOOK
from tests.conftest import DATA, ROOT

CASES = sorted((DATA / "failure_signatures").glob("*.yml"))
FINDINGS_HEADING = "## What `gpufleet diag`'s findings mean"


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_the_findings_in_collected_text(path: Path) -> None:
    case = yaml.safe_load(path.read_text())
    found = scan(case["node"], case["unit"], case["lines"])
    seen = [{"signature": f.signature, "first_seen": f.first_seen, "count": f.count} for f in found]
    assert seen == [{k: e[k] for k in ("signature", "first_seen", "count")} for e in case["expected"]]
    for finding, expected in zip(found, case["expected"], strict=True):
        assert finding.node == case["node"] and finding.unit == case["unit"]
        assert finding.finding == expected.get("finding", finding.finding)
        line = finding.line()
        assert line.startswith(f"{case['node']}: ") and line.endswith(f"read {RUNBOOK}#{finding.runbook}"), line


def _sections() -> dict[str, str]:
    """The runbook's sections under the findings heading, by heading."""
    text = (ROOT / RUNBOOK).read_text()
    assert FINDINGS_HEADING in text
    part = text.split(FINDINGS_HEADING, 1)[1]
    heads = re.split(r"^### (\S+)\n", part, flags=re.M)
    return dict(zip(heads[1::2], heads[2::2], strict=True))


def test_every_signature_has_its_runbook_section_and_every_section_a_signature() -> None:
    sections = _sections()
    assert set(sections) == {s.id for s in catalog()} | {XID_RUNBOOK}
    for signature in catalog():  # each section quotes what its patterns find
        assert "`" in sections[signature.id], signature.id


def test_every_case_finds_something_and_every_signature_is_found_by_a_case() -> None:
    found = {e["signature"] for path in CASES for e in yaml.safe_load(path.read_text())["expected"]}
    assert {s.id for s in catalog()} <= found
    assert any(name.startswith("xid_") for name in found)


BAD: dict[str, tuple[Any, str]] = {
    "no signatures key": ({"signature": {}}, "expected one key, signatures"),
    "an unknown key": ({"signatures": {"a": {"finding": "f", "units": ["u"], "patterns": ["p"], "source": "s",
                                             "runbook": "r"}}}, "found finding, patterns, runbook, source, units"),
    "a missing key": ({"signatures": {"a": {"finding": "f", "units": ["u"], "patterns": ["p"]}}},
                      "expected the keys finding, patterns, source, units, found finding, patterns, units"),
    "a bad id": ({"signatures": {"A-b": {"finding": "f", "units": ["u"], "patterns": ["p"], "source": "s"}}},
                 "signatures.A-b: expected an id"),
    "an empty pattern list": ({"signatures": {"a": {"finding": "f", "units": ["u"], "patterns": [], "source": "s"}}},
                              "signatures.a.patterns: expected a list of non-empty strings"),
    "a pattern that does not compile": (
        {"signatures": {"a": {"finding": "f", "units": ["u"], "patterns": ["(unclosed"], "source": "s"}}},
        "signatures.a.patterns: missing ), unterminated subpattern"),
    "an empty finding": ({"signatures": {"a": {"finding": " ", "units": ["u"], "patterns": ["p"], "source": "s"}}},
                         "expected finding and source to be non-empty strings"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_catalog_that_breaks_its_rules_is_named_in_one_line(case: str) -> None:
    doc, expected = BAD[case]
    with pytest.raises(CatalogError) as refused:
        parse_catalog(doc)
    assert expected in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
