"""How repeatable ``gpufleet bench`` is on the running lab: each replica shape's ceiling, measured several times.

    python bench/serving_ceiling.py                                  # 2 runs of each shape, the ramp's defaults
    python bench/serving_ceiling.py --runs 3 --slo ttft_p99_s=0.25,itl_p99_s=0.05 --step-s 10 --dataset FILE

Needs the lab up and deployed (``make lab``; ``$GPUFLEET_LAB_DIR`` picks another lab). For each replica of the
lab's default layout (lab1's one-node replica, the pipeline over lab2 and lab3) it runs ``gpufleet bench
inventories/lab/inventory.py --replica NAME`` ``--runs`` times (the client on this machine; each run's record
replaces the
last on the monitoring host) and prints JSON: per shape each run's ceiling, what stopped it, its steps (rate, p99
TTFT and ITL, failures, vLLM's KV cache usage and preemptions) and wall seconds, and the runs' spread (the largest
ceiling over the smallest, less one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpufleet_lab.mirror import bench_client_find_links
from gpufleet_lab.nodes import TLS_DIR
from gpufleet_lab.state import LAB_DIR_ENV, lab_dir, load_state

ROOT = Path(__file__).resolve().parents[1]
INVENTORY = "inventories/lab/inventory.py"
PIPELINE = "lab_pipeline-0"


def _replicas() -> dict[str, str]:
    state = load_state()
    if state is None or len(state.nodes) < 3:
        sys.exit("bench/serving_ceiling.py: expected a lab of three nodes up (make lab)")
    return {"tp1-pp1": f"lab_single-{state.nodes[0].address.replace('.', '-')}", "tp1-pp2": PIPELINE}


def _run(replica: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    report = folder / f"{replica}-{time.monotonic_ns()}.json"
    argv = [sys.executable, "-m", "gpufleet.cli.main", "bench", INVENTORY, "--replica", replica, "--step-s",
            str(args.step_s), "--ca-file", str(lab_dir() / TLS_DIR / "ca.crt"), "--report", str(report)]
    argv += [*(["--slo", args.slo] if args.slo else []), *(["--rates", args.rates] if args.rates else []),
             *(["--dataset", args.dataset] if args.dataset else [])]
    env = {**os.environ, LAB_DIR_ENV: str(lab_dir())}
    started = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    took = time.monotonic() - started
    if done.returncode != 0:
        return {"exit": done.returncode, "error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    record = json.loads(report.read_text())
    steps = [{key: step[key] for key in ("rate", "achieved_rps", "ttft_p99_s", "itl_p99_s", "failed", "kv_usage_max",
                                         "preemptions")} for step in record["steps"]]
    return {"ceiling_rps": record["ceiling_rps"], "stopped_by": record["stopped_by"], "steps": steps,
            "wall_s": round(took, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs of each shape (default 2)")
    parser.add_argument("--slo", help="gpufleet bench --slo (default: the pools' objective)")
    parser.add_argument("--rates", help="gpufleet bench --rates (default: its doubling ramp)")
    parser.add_argument("--step-s", type=float, default=10.0, help="seconds a step sends (default 10)")
    parser.add_argument("--dataset", help="gpufleet bench --dataset (default: random lengths from max_model_len)")
    args = parser.parse_args()
    installed = subprocess.run([sys.executable, "-m", "gpufleet.cli.main", "bench-client", "--find-links",
                                bench_client_find_links()], cwd=ROOT, capture_output=True, text=True)
    if installed.returncode != 0:
        sys.exit(f"bench/serving_ceiling.py: {(installed.stderr or installed.stdout).strip()}")
    found: dict[str, Any] = {"slo": args.slo, "rates": args.rates, "step_s": args.step_s, "dataset": args.dataset,
                             "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for layout, replica in _replicas().items():
            runs = [_run(replica, args, Path(tmp)) for _ in range(args.runs)]
            ceilings = [r["ceiling_rps"] for r in runs if r.get("ceiling_rps")]
            spread = round(max(ceilings) / min(ceilings) - 1, 3) if len(ceilings) == len(runs) else None
            found["shapes"][layout] = {"replica": replica, "runs": runs, "spread": spread}
    print(json.dumps(found, indent=2))


if __name__ == "__main__":
    main()
