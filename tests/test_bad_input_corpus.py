"""The bad-input corpus (tests/corpus/*.yaml): every case exits 2 with its line, fast, before any connection.

A small valid project, one edit per case, through the real `gpufleet check` and the real `pyinfra`.

A case is data::

    - id: port-is-bool
      set: {vllm_port: true}           # merged into `file` (default group_vars/all.yml)
      expect: "group_vars/all.yml: vllm_port: expected an integer, found True (host 127.0.0.1)"

Edits: ``set`` (mapping merged into a YAML file), ``unset`` (keys removed from it), ``raw`` / ``raw_b64``
(the file's whole text / bytes), ``mkdir`` (a directory where a file is expected), ``file`` (which file:
``group_vars/<name>.yml`` or ``inventory``), ``host`` (data merged into the host's inventory entry),
``hosts`` (more ``[name, data]`` entries in the same group), ``groups`` (more inventory lines),
``data`` (``--data KEY=VALUE`` arguments). ``expect`` is the exact first line on stderr (pyinfra's
``--> …`` progress lines skipped). The project holds gpufleet's ``config.py``, as a user's does: pyinfra runs it
before the inventory, so an inventory file that does not compile or run is one line and exit 2 there too.

The host is 127.0.0.1 with ``ssh_port`` on a loopback listener the test opens: a case that slipped
through would connect to it. "Fast" is measured as the CPU time of each command (under 2 s), which
other load on the machine does not inflate; a hung command is killed after HANG_SECONDS.
"""

from __future__ import annotations

import base64
import concurrent.futures
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
BIN = Path(sys.executable).parent
BASE_ALL = {
    "vllm_model": "meta-llama/Llama-3.1-8B-Instruct",
    "gpu_profile": "8xH100-SXM",
    "vllm_max_model_len": 8192,
}
HOST = "127.0.0.1"
HANG_SECONDS = 30


@dataclass
class Run:
    rc: int
    first_line: str
    stderr: str
    seconds: float  # CPU time


def load_cases() -> list[dict[str, Any]]:
    """Every case of every corpus file, with its category (the file's stem)."""
    cases = []
    for path in sorted(CORPUS_DIR.glob("*.yaml")):
        for case in yaml.safe_load(path.read_text()):
            cases.append({**case, "category": path.stem})
    return cases


class Listener:
    """A loopback TCP port that counts the connections it accepts (and closes them at once)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((HOST, 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def _inventory(case: dict[str, Any], port: int) -> str:
    host_data = {"ssh_port": port, "ssh_user": "root", **(case.get("host") or {})}
    entries = [(HOST, host_data)] + [tuple(h) for h in case.get("hosts") or []]
    body = case.get("groups") or ""
    return ("from gpufleet.config.inventory import apply_group_vars\n"
            f"servers = {entries!r}\n{body}\napply_group_vars(globals())\n")


def build_project(case: dict[str, Any], root: Path, port: int) -> list[str]:
    """Write the base project with the case's edit into ``root``; returns the ``--data`` arguments."""
    (root / "inventories").mkdir(parents=True)
    (root / "group_vars").mkdir()
    inventory = root / "inventories" / "fleet.py"
    inventory.write_text(_inventory(case, port))
    (root / "group_vars" / "all.yml").write_text(yaml.safe_dump(BASE_ALL, sort_keys=False))
    (root / "deploy.py").write_text("")
    shutil.copy(ROOT / "config.py", root / "config.py")  # a project's pyinfra config: one-line inventory errors
    name = case.get("file", "group_vars/all.yml")
    target = inventory if name == "inventory" else root / name
    if "set" in case or "unset" in case:
        values = yaml.safe_load(target.read_text()) if target.exists() else {}
        values = {**(values or {}), **(case.get("set") or {})}
        for key in case.get("unset") or []:
            values.pop(key, None)
        target.write_text(yaml.safe_dump(values, sort_keys=False, allow_unicode=True))
    if "raw" in case:
        target.write_text(case["raw"])
    if "raw_b64" in case:
        target.write_bytes(base64.b64decode(case["raw_b64"]))
    if case.get("mkdir"):
        target.unlink(missing_ok=True)
        target.mkdir()
    return [arg for item in case.get("data") or [] for arg in ("--data", item)]


def _first_line(stderr: str) -> str:
    """The first line that is not pyinfra's own progress banner."""
    return next((line for line in stderr.splitlines() if line.strip() and not line.startswith("--> ")), "")


def run(argv: list[str], cwd: Path) -> Run:
    """Run a command; its time is the CPU time it used (user + system, from wait4), which other load on
    the machine does not inflate; a hang is cut at HANG_SECONDS of wall time."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=err, env=env)
        watchdog = threading.Timer(HANG_SECONDS, proc.kill)
        watchdog.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            watchdog.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read().decode("utf-8", "replace")
    return Run(proc.returncode, _first_line(stderr), stderr, usage.ru_utime + usage.ru_stime)


def run_case(case: dict[str, Any], root: Path, port: int) -> tuple[Run, Run]:
    """The case through ``gpufleet check`` and through ``pyinfra -y <inventory> <empty deploy>``."""
    data = build_project(case, root, port)
    check = run([str(BIN / "gpufleet"), "check", *data, "inventories/fleet.py"], root)
    pyinfra = run([str(BIN / "pyinfra"), "-y", *data, "inventories/fleet.py", "deploy.py"], root)
    return check, pyinfra


# -- the tests ----------------------------------------------------------------------------------------

CASES = load_cases()
WORKERS = 2
MAX_SECONDS = 2.0


@pytest.fixture(scope="module")
def results() -> dict[str, tuple[Run, Run, int]]:
    """Every case run once, a few at a time: id -> (gpufleet check, pyinfra, connections accepted)."""
    out: dict[str, tuple[Run, Run, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:

        def one(case: dict[str, Any]) -> None:
            listener = Listener()
            try:
                check, pyinfra = run_case(case, Path(tmp) / case["category"] / case["id"], listener.port)
            finally:
                listener.close()
            out[f"{case['category']}/{case['id']}"] = (check, pyinfra, listener.accepted)

        with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
            list(pool.map(one, CASES))
    return out


def test_corpus_is_large_and_ids_unique() -> None:
    ids = [f"{c['category']}/{c['id']}" for c in CASES]
    assert len(ids) >= 200 and len(set(ids)) == len(ids)
    assert all(c.get("expect") for c in CASES)


def test_base_project_is_valid_and_reaches_the_listener(tmp_path: Path) -> None:
    """Without an edit, check passes and pyinfra connects: the listener would see a case that slipped through."""
    listener = Listener()
    try:
        check, pyinfra = run_case({"id": "base"}, tmp_path / "base", listener.port)
        deadline = time.monotonic() + 5
        while not listener.accepted and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        listener.close()
    assert check.rc == 0, check.stderr
    assert pyinfra.rc != 2 and listener.accepted >= 1, pyinfra.stderr


@pytest.mark.parametrize("case", CASES, ids=[f"{c['category']}/{c['id']}" for c in CASES])
def test_bad_input_exits_2_with_its_line_before_any_connection(
        case: dict[str, Any], results: dict[str, tuple[Run, Run, int]]) -> None:
    check, pyinfra, accepted = results[f"{case['category']}/{case['id']}"]
    assert (check.rc, check.first_line) == (2, case["expect"]), check.stderr
    assert "Traceback" not in check.stderr
    assert check.seconds < MAX_SECONDS
    assert accepted == 0, "pyinfra connected to the host"
    assert (pyinfra.rc, pyinfra.first_line) == (2, case["expect"]), pyinfra.stderr
    assert "Traceback" not in pyinfra.stderr
    assert pyinfra.seconds < MAX_SECONDS
