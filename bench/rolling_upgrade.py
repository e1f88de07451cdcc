"""Rolling upgrades under load on the running lab: what clients see while ``gpufleet upgrade`` and ``gpufleet rollback``
move every replica to another vLLM release and back.

    python bench/rolling_upgrade.py                        # 1 and 4 client streams, to 0.32.0 and back
    python bench/rolling_upgrade.py --streams 2 --to 0.32.0 --canary-s 20

Needs the lab up and deployed (``make lab``; ``$GPUFLEET_LAB_DIR`` picks another lab) on the release it starts
from. For each size (the number of client streams through the routers' virtual address, over TLS with the lab
client's key, each a completion and a turn of its conversation in turn, one request a second) it runs
``gpufleet upgrade inventories/lab/inventory.py --data vllm_version=TO``, then
``gpufleet rollback inventories/lab/inventory.py``,
each under that load (``gpufleet_lab.request_load``, bounded by the rollout's own time limit). Prints JSON: per
rollout its exit, wall seconds, requests sent and failed, latency median and 99th percentile, the requests the
router retried or redispatched (its Prometheus counters), and each replica's outcome and step times from the
rollout's own report. A rollout that fails ends the run (the fleet is
then on whatever the report says).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from gpufleet_lab.network import virtual_address
from gpufleet_lab.nodes import CLIENT_KEY_FILE, TLS_DIR
from gpufleet_lab.request_load import RequestLoad
from gpufleet_lab.state import LAB_DIR_ENV, lab_dir, load_state

ROOT = Path(__file__).resolve().parents[1]
INVENTORY = "inventories/lab/inventory.py"
ROUTER_PORT, ROUTER_METRICS_PORT = 8080, 8405  # roles/router/defaults.yml
ROLLOUT_LIMIT_S = 3600
RETRY_COUNTERS = ("haproxy_backend_retry_warnings_total", "haproxy_backend_redispatch_warnings_total")


def router_retries(router: str) -> float:
    """Requests the router sent again (retried, or redispatched to another replica), over every backend."""
    with urllib.request.urlopen(f"http://{router}:{ROUTER_METRICS_PORT}/metrics", timeout=20) as answer:
        text = answer.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(RETRY_COUNTERS))


def rollout(args: list[str], load: RequestLoad, router: str, directory: Path) -> dict[str, Any]:
    """One ``gpufleet`` rollout command under ``load``: its figures."""
    with tempfile.TemporaryDirectory() as scratch:
        report_path = Path(scratch) / "report.json"
        retried = router_retries(router)
        load.start()
        started = time.monotonic()
        try:
            time.sleep(3)  # requests in flight before the first drain
            done = subprocess.run([sys.executable, "-m", "gpufleet.cli.main", *args, "--report", str(report_path)],
                                  cwd=ROOT, env={**os.environ, LAB_DIR_ENV: str(directory)}, capture_output=True,
                                  text=True, timeout=ROLLOUT_LIMIT_S)
        finally:
            load.stop()
        seconds = time.monotonic() - started
        report = json.loads(report_path.read_text()) if report_path.exists() else None
    figures: dict[str, Any] = {"command": " ".join(args[:1] + args[2:]), "exit": done.returncode,
                               "seconds": round(seconds, 1), **load.figures(),
                               "retried": router_retries(router) - retried, "failures": load.failures[:5]}
    if report is None:
        figures["output_tail"] = (done.stdout + done.stderr).splitlines()[-20:]
    else:
        figures["replicas"] = [{key: entry[key] for key in ("replica", "state", "change", "seconds")}
                               for entry in report["replicas"]]
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,4", help="client stream counts, comma-separated (default 1,4)")
    parser.add_argument("--to", default="0.32.0", help="the vLLM release to upgrade to (default 0.32.0)")
    parser.add_argument("--batches", default="1,100%")
    parser.add_argument("--canary-s", default="20")
    args = parser.parse_args()
    directory = lab_dir()
    state = load_state(directory)
    if state is None or not state.nodes:
        print(f"bench/rolling_upgrade.py: no lab in {directory} (make lab)", file=sys.stderr)
        return 2
    router = state.nodes[0].address  # inventories/lab/inventory.py: a router on lab1 (its metrics)
    # clients reach the routers through their virtual address (a lab of one node: lab1's own), over TLS, with
    # the key of the routers' client "lab"
    edge = (str(virtual_address(ipaddress.IPv4Network(state.subnet))) if len(state.nodes) > 1 else router)
    lab_vars = yaml.safe_load((ROOT / "inventories" / "lab" / "group_vars" / "lab.yml").read_text())
    model, key = lab_vars["vllm_served_model_name"], (directory / CLIENT_KEY_FILE).read_text().strip()
    rollout_args = ["--batches", args.batches, "--canary-s", args.canary_s]
    commands = [["upgrade", INVENTORY, *rollout_args, "--data", f"vllm_version={args.to}"],
                ["rollback", INVENTORY, *rollout_args]]
    planned = [(int(n), command) for n in args.streams.split(",") for command in commands]
    runs: list[dict[str, Any]] = []
    for streams, command in planned:
        load = RequestLoad(f"https://{edge}:{ROUTER_PORT}", model, key, streams=streams, pause_s=1.0,
                           chat=True, limit_s=ROLLOUT_LIMIT_S, limit=10 * ROLLOUT_LIMIT_S,
                           ca_file=str(directory / TLS_DIR / "ca.crt"))
        runs.append({"streams": streams, **rollout(command, load, router, directory)})
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)  # progress: each rollout as it ends
        if runs[-1]["exit"] != 0:
            break
    print(json.dumps({"lab": {"nodes": len(state.nodes), "from": lab_vars["vllm_version"], "to": args.to},
                      "runs": runs}, indent=2))
    return 0 if all(run["exit"] == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
