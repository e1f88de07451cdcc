"""``gpufleet diag`` on the lab, after the faults of scenario ``faults`` (its last test: the file sorts after every
other of the scenario): one run over the scenario's window names each fault the scenario's tests injected, on the
node it happened on, with its runbook section (docs/guide/when-things-fail.md):

- kill -9 of either pipeline rank (tests/lab/test_faults.py): ``rank_lost_peer`` on both ranks' nodes, lab2 and lab3;
- lab1's engine wedged (SIGSTOP) and restarted by its watchdog (test_faults.py): ``engine_stalled`` on lab1;
- a GPU lost on lab1 (tests/lab/test_alerts.py): ``gpu_gate_failed`` on lab1;
- an Xid 79 written to lab1's kernel log (tests/lab/test_lifecycle.py): ``xid`` (code 79) and ``node_quarantined``;
- lab2 powered off halfway through a deploy (test_faults.py): ``unclean_restart`` on lab2, and on no other node
  (lab3 was rebooted by a provision, with a shutdown);
- lab1's replica kept from starting by a flag its release removed, its model's files gone and its port taken
  (test_faults.py): ``flag_removed``, ``model_missing`` and ``port_taken`` on lab1.

The archive also holds each node's series from lab1's Prometheus over the window: among lab1's, the alert the
critical Xid of tests/lab/test_alerts.py raised.

Run alone, the test finds none of them and fails naming the test that injects each. The same archive, of a lab whose
secrets are all set (its hub token a stand-in: the lab's model is pushed), holds none of them: each is searched in
every byte of the archive, of its decompressed tar stream, and of each member. Its figures (time and size per node,
and for the lab) go to the session's lab-fault-figures.jsonl.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from gpufleet_lab import nodes as lab_files

from gpufleet import node_paths
from gpufleet.monitoring.alert_rules import RUNBOOK
from tests.lab.fleet import INVENTORY, PIPELINE, record_figure
from tests.lab.harness import ROOT, Completed, Lab

pytestmark = pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning")

FINDING = re.compile(r"^  (?P<host>\S+): (?P<text>.*); read " + re.escape(RUNBOOK) + r"#(?P<runbook>\w+)$", re.M)
NODE_LINE = re.compile(r"^(?P<host>\S+): (?P<seconds>[\d.]+) s, (?P<bytes>[\d,]+) bytes", re.M)
# (node index, runbook section, text the finding holds): what each fault of the scenario leaves, and its test
EXPECTED = (
    (1, "rank_lost_peer", "", "test_faults.py::test_kill_9_of_any_rank_restarts_the_whole_pipeline_replica_once"),
    (2, "rank_lost_peer", "", "test_faults.py::test_kill_9_of_any_rank_restarts_the_whole_pipeline_replica_once"),
    (0, "engine_stalled", "", "test_faults.py::test_a_wedged_engine_is_restarted_by_the_watchdog_while_..."),
    (0, "gpu_gate_failed", "gpufleet-gpu-watch", "test_alerts.py::test_gpu_faults_a_stalled_engine_and_..."),
    (0, "xid", "Xid 79 ", "test_lifecycle.py::test_an_xid_79_under_load_drains_quarantines_and_readmits_the_node"),
    (0, "node_quarantined", "", "test_lifecycle.py::test_an_xid_79_under_load_drains_quarantines_and_readmits_..."),
    (1, "unclean_restart", "", "test_faults.py::test_a_router_node_lost_halfway_through_a_deploy_moves_the_..."),
    (0, "flag_removed", "", "test_faults.py::test_a_replica_that_cannot_start_says_why_and_starts_once_mended"),
    (0, "model_missing", "", "test_faults.py::test_a_replica_that_cannot_start_says_why_and_starts_once_mended"),
    (0, "port_taken", "", "test_faults.py::test_a_replica_that_cannot_start_says_why_and_starts_once_mended"),
)


def _secrets(lab: Lab) -> dict[str, list[str]]:
    """Every secret the lab set, by name: the controller's files, and the pipeline's rank secret (on its nodes only);
    a PEM key by each line of its body (what a copy cut to lines would still show)."""
    found = {name: [(lab.directory / name).read_text().strip()]
             for name in (lab_files.API_KEY_FILE, lab_files.CLIENT_KEY_FILE, lab_files.BENCH_KEY_FILE,
                          lab_files.METERED_KEY_FILE, lab_files.DAILY_KEY_FILE, lab_files.HUB_TOKEN_FILE,
                          lab_files.RAY_TOKEN_FILE, lab_files.VRRP_PASSWORD_FILE)}
    for key in ("ca.key", "router.key"):
        body = [line for line in (lab.directory / lab_files.TLS_DIR / key).read_text().splitlines()
                if "-----" not in line]
        found[f"{lab_files.TLS_DIR}/{key}"] = [line for line in body if len(line) >= 16]
    rank = lab.host(lab.nodes[1]).check_output(f"cat {node_paths.rank_secret_file(PIPELINE)}")
    found["the rank secret"] = re.findall(r"^GPUFLEET_RANK_SECRET=\"?([^\"\n]+)", rank, re.M)
    assert all(values and all(values) for values in found.values()), found.keys()
    return found


def _layers(archive: bytes) -> dict[str, bytes]:
    """The archive as written, its tar stream, and each member (the nodes' own archives are stored unpacked)."""
    stream = gzip.decompress(archive)
    layers = {"the archive": archive, "its tar stream": stream}
    with tarfile.open(fileobj=io.BytesIO(stream)) as tar:
        for member in tar:
            if member.isfile():
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
                layers[member.name] = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
    return layers


def test_diag_names_each_fault_of_the_scenario_on_its_node_and_keeps_no_secret(
        lab: Lab, faults: Completed | None, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    out = tmp_path / "diag.tar.gz"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "gpufleet.cli.main", "diag", INVENTORY, "--since", "3h",
                           "--out", str(out)], cwd=ROOT, env=lab.env, capture_output=True, text=True, timeout=180)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    by_address = {node.address: node.name for node in lab.nodes}
    found = {(by_address.get(m["host"], m["host"]), m["runbook"], m["text"]) for m in FINDING.finditer(done.stdout)}
    missing = [f"{lab.nodes[index].name}: {runbook} (injected by {test})" for index, runbook, text, test in EXPECTED
               if not any(node == lab.nodes[index].name and section == runbook and text in said
                          for node, section, said in found)]
    assert not missing, f"not named: {missing}\n{done.stdout[-4000:]}"
    unclean = sorted({node for node, section, _ in found if section == "unclean_restart"})
    assert unclean == [lab.nodes[1].name], unclean  # lab3's reboot by the provision had its shutdown
    # the findings come first, then the archive, then each node within its bound
    archive_at = done.stdout.index("archive: ")
    assert done.stdout.index("findings: ") < archive_at
    nodes = {m["host"]: (float(m["seconds"]), int(m["bytes"].replace(",", "")))
             for m in NODE_LINE.finditer(done.stdout, archive_at)}
    assert set(nodes) == set(by_address) and all(0 < s <= 60 and b > 0 for s, b in nodes.values()), nodes
    assert out.stat().st_mode & 0o777 == 0o600
    archive = out.read_bytes()
    # each node's series from lab1's Prometheus over the window: its scrape health, and on lab1 the critical Xid
    # tests/lab/test_alerts.py injected (an alert of the window, resolved since)
    layers = _layers(archive)
    series = {node.name: json.loads(layers[f"series/{node.address}.json"])["series"] for node in lab.nodes}
    assert all(any(s["metric"]["__name__"] == "up" for s in found) for found in series.values()), series.keys()
    alerts = {s["metric"].get("alertname") for s in series[lab.nodes[0].name] if s["metric"]["__name__"] == "ALERTS"}
    assert "GpuCriticalXid" in alerts, alerts
    leaks = [f"{name} in {where}" for name, values in _secrets(lab).items() for where, data in layers.items()
             for value in values if value.encode() in data]
    assert not leaks, leaks
    record_figure(tmp_path_factory, {
        "figure": "gpufleet diag of the lab after the faults scenario", "seconds": round(took, 1),
        "archive_bytes": len(archive), "findings": len(found),
        "series_bytes": {node.name: len(layers[f"series/{node.address}.json"]) for node in lab.nodes},
        "nodes": {by_address[host]: {"seconds": s, "bytes": b} for host, (s, b) in nodes.items()}})
