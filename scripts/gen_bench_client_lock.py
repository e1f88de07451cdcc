#!/usr/bin/env python3
"""Regenerate the bench client's lock, gpufleet/data/guidellm/requirements-<version>.lock.

Usage: python scripts/gen_bench_client_lock.py [--find-links DIR|URL]... [--extra-index-url URL]... [--keep DIR]

guidellm at ``gpufleet.measure.guidellm_client.VERSION`` and the lab's torch (its CPU build, ``torch==...+cpu`` of
``gpufleet_lab.wheelhouse.EXTRA_REQUIREMENTS``, which PyPI lacks: name where it is with ``--find-links`` or
``--extra-index-url``, e.g. https://download.pytorch.org/whl/cpu) are resolved by pip for the lab's target
(CPython 3.11, glibc 2.36, x86_64: Debian 12, the controller's and the nodes'), from PyPI and those sources alone
(pip's configuration is ignored) and from files uploaded before :data:`UPLOADED_PRIOR_TO`, so that the same inputs
give the same lock. Every resolved wheel is downloaded and hashed here (``--keep DIR`` keeps them: a wheelhouse for
``gpufleet bench-client --wheelhouse DIR``); the lock pins each with its sha256. It prints what it resolved as JSON:
the pins, the wheels' total size and the seconds it took.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpufleet_lab.wheelhouse import ABI, EXTRA_REQUIREMENTS, PLATFORMS
from packaging.utils import canonicalize_name, parse_wheel_filename

from gpufleet.digest import file_sha256
from gpufleet.measure.client_env import lock_path, target_args
from gpufleet.measure.guidellm_client import VERSION

#: Only files uploaded before this instant are candidates (move it on deliberately, with VERSION or the torch pin).
UPLOADED_PRIOR_TO = "2026-11-26T00:00:00Z"
TORCH = next(r for r in EXTRA_REQUIREMENTS if r.startswith("torch=="))
TARGET = f"{ABI}-{PLATFORMS[0]}"
REQUIREMENTS = (f"guidellm=={VERSION}", TORCH)


def _pip(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", *args[:1], "--only-binary=:all:",
           "--progress-bar", "off", *target_args(TARGET), *args[1:]]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--find-links", action="append", default=[],
                        help="also look for wheels there (torch's CPU build)")
    parser.add_argument("--extra-index-url", action="append", default=[], help="another index (PyTorch's CPU index)")
    parser.add_argument("--keep", type=Path, help="keep the downloaded wheels in this directory (a wheelhouse)")
    args = parser.parse_args()
    sources = [a for link in args.find_links for a in ("--find-links", link)]
    sources += [a for url in args.extra_index_url for a in ("--extra-index-url", url)]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-lock-") as tmp:
        report, pins, dest = Path(tmp) / "report.json", Path(tmp) / "pins.txt", args.keep or Path(tmp) / "wheels"
        _pip(["install", "--dry-run", "--ignore-installed", "--quiet", "--uploaded-prior-to", UPLOADED_PRIOR_TO,
              "--report", str(report), *sources, *REQUIREMENTS])
        resolved = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
                    for item in json.loads(report.read_text())["install"]}
        pins.write_text("".join(f"{name}=={version}\n" for name, version in sorted(resolved.items())))
        dest.mkdir(parents=True, exist_ok=True)
        _pip(["download", "--no-deps", "--quiet", "--dest", str(dest), *sources, "-r", str(pins)])
        wheels: dict[str, Path] = {}
        for wheel in dest.glob("*.whl"):
            name, version, _, _ = parse_wheel_filename(wheel.name)
            if resolved.get(name) == str(version):
                wheels[name] = wheel
        if missing := sorted(set(resolved) - set(wheels)):
            sys.exit(f"pip resolved {', '.join(missing)} but downloaded no wheel of it")
        lines = [f"# gpufleet bench's client: guidellm {VERSION} and every wheel it needs (torch: its CPU build),"
                 " each pinned with its sha256.",
                 "# Install with --no-deps --require-hashes: gpufleet bench-client. Written by"
                 " scripts/gen_bench_client_lock.py (make bench-client-lock).",
                 f"# resolved: {' '.join(REQUIREMENTS)}, from files uploaded before {UPLOADED_PRIOR_TO}",
                 f"# target: {TARGET}"]
        lines += [f"{name}=={resolved[name]} --hash=sha256:{file_sha256(wheels[name])}" for name in sorted(wheels)]
        out = lock_path(VERSION)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
        size = sum(wheel.stat().st_size for wheel in wheels.values())
    print(json.dumps({"lock": str(out.relative_to(Path(__file__).resolve().parents[1])), "pins": len(wheels),
                      "size_bytes": size, "seconds": round(time.monotonic() - started, 1)}))


if __name__ == "__main__":
    main()
