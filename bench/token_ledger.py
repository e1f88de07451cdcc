"""What the token ledger costs a request: the latency through the routers of a client with a token budget against
one without, on the running lab, at its load.

    make lab
    python bench/token_ledger.py                   # 60 requests each, 2 at a time, max_tokens 1
    python bench/token_ledger.py --requests 200 --concurrency 4 --max-tokens 16

Needs the lab up (``$GPUFLEET_LAB_DIR`` picks another), deployed as ``make lab`` deploys it: its clients ``bench``
(no budget) and ``daily`` (a day's token budget far above what this sends: every request is admitted, each asks the
ledger before it is admitted and settles when it ends). Both send the same completion through the routers' virtual
address, interleaved request by request, so that each sees the same replicas under the same load. A client's time
is from its request sent to its answer's last byte (http.client on a connection of its own, TLS included).

Prints one JSON document: each client's p50/p90/p99 and mean seconds, how many failed, and the differences (the
metered client's less the other's) of the p50 and the mean: the ledger's cost per request at that load.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import ssl
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpufleet_lab.network import virtual_address
from gpufleet_lab.nodes import BENCH_KEY_FILE, DAILY_KEY_FILE, TLS_DIR
from gpufleet_lab.state import lab_dir, load_state

ROUTER_PORT = 8080
PROMPT = "The fleet is"


def one(host: str, key: str, body: bytes, context: ssl.SSLContext) -> tuple[float, int | None]:
    """One completion: its seconds and status (None: no answer)."""
    started = time.monotonic()
    connection = http.client.HTTPSConnection(host, ROUTER_PORT, timeout=60, context=context)
    try:
        connection.request("POST", "/v1/completions", body,
                           {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        return time.monotonic() - started, response.status
    except (OSError, http.client.HTTPException):
        return time.monotonic() - started, None
    finally:
        connection.close()


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)

    def at(share: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(len(ordered) * share))], 4)

    return {"p50_s": at(0.5), "p90_s": at(0.9), "p99_s": at(0.99), "mean_s": round(statistics.fmean(ordered), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60, help="requests per client (default 60)")
    parser.add_argument("--concurrency", type=int, default=2, help="requests at once, both clients (default 2)")
    parser.add_argument("--max-tokens", type=int, default=1, help="each completion's (default 1)")
    args = parser.parse_args(argv)
    if not 1 <= args.requests <= 1000 or not 1 <= args.concurrency <= 16 or not 1 <= args.max_tokens <= 256:
        parser.error("--requests 1-1000, --concurrency 1-16, --max-tokens 1-256")
    state = load_state()
    if state is None:
        sys.exit(f"no lab is up in {lab_dir()}")
    host = str(virtual_address(ipaddress.IPv4Network(state.subnet)))
    context = ssl.create_default_context(cafile=str(lab_dir() / TLS_DIR / "ca.crt"))
    keys = {name: (lab_dir() / file).read_text().strip() for name, file in (("bench", BENCH_KEY_FILE),
                                                                           ("daily", DAILY_KEY_FILE))}
    probe = http.client.HTTPSConnection(host, ROUTER_PORT, timeout=30, context=context)
    try:
        probe.request("GET", "/v1/models", headers={"Authorization": f"Bearer {keys['bench']}"})
        model = json.loads(probe.getresponse().read())["data"][0]["id"]
    finally:
        probe.close()
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": args.max_tokens, "ignore_eos": True}).encode()
    order = [name for _ in range(args.requests) for name in ("bench", "daily")]
    with ThreadPoolExecutor(args.concurrency) as pool:
        done = list(pool.map(lambda name: (name, *one(host, keys[name], body, context)), order))
    report: dict[str, Any] = {"requests_per_client": args.requests, "concurrency": args.concurrency,
                              "max_tokens": args.max_tokens, "model": model}
    for name in ("bench", "daily"):
        times = [took for who, took, status in done if who == name and status == 200]
        report[name] = {**(summary(times) if times else {}),
                        "failed": sum(1 for who, _, status in done if who == name and status != 200)}
    if all("p50_s" in report[name] for name in ("bench", "daily")):
        report["ledger_added_p50_s"] = round(report["daily"]["p50_s"] - report["bench"]["p50_s"], 4)
        report["ledger_added_mean_s"] = round(report["daily"]["mean_s"] - report["bench"]["mean_s"], 4)
    print(json.dumps(report, indent=1))
    return 0 if report["bench"]["failed"] == report["daily"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
