"""The bad-input corpus (tests/data/corpus/*.yaml): every case exits 2 with its line, fast, before any connection.

A small valid project, one edit per case. A case is data::

    - id: port-is-bool
      set: {vllm_port: true}           # merged into `file` (default group_vars/all.yml)
      expect: "group_vars/all.yml: vllm_port: expected an integer, found True (host 127.0.0.1)"

Edits: ``set`` (mapping merged into a YAML file), ``unset`` (keys removed from it), ``raw`` / ``raw_b64``
(the file's whole text / bytes), ``mkdir`` (a directory where a file is expected), ``fifo`` (a named pipe
there, which nothing may wait to read), ``file`` (which file:
``group_vars/<name>.yml`` or ``inventory``), ``host`` (data merged into the host's inventory entry),
``hosts`` (more ``[name, data]`` entries in the same group), ``groups`` (more inventory lines),
``after`` (inventory lines after its ``apply_group_vars(globals())``), ``paths`` (more files in the project, by
relative path: ``dir/`` a directory, ``-> TARGET`` a link, ``|fifo`` a named pipe, ``|private-key`` a key made
for the run, ``|tls:KIND`` a TLS file made for the run (tests/unit/tls_files.py), else the file's text),
``data`` (``--data KEY=VALUE`` arguments), ``env`` (environment variables set for the commands, over :data:`ENV`,
whose VRRP password the virtual address's cases name). ``expect`` is the exact first line on stderr (pyinfra's ``--> …``
progress lines skipped); ``never_shown``, a secret the case plants, is on no line of it. A credential-shaped text is
written ``<token:KIND>`` (hf, sk, ghp, plain), drawn for each run (:data:`TOKENS`). The project holds
gpufleet's ``config.py``, as a user's
does: pyinfra runs it before the inventory, so an inventory file that does not compile or run is one line and exit 2
there too.

Every case runs in this process, one test each (``-k 'names/<id>'`` runs one), through both entry points:

- ``gpufleet check [--data …] inventories/fleet.py``: the click command, through click's CliRunner;
- pyinfra reading the inventory, as ``pyinfra -y [--data …] inventories/fleet.py deploy.py`` does: the project's
  ``config.py`` through pyinfra's ``exec_file``, then ``pyinfra_cli.inventory.make_inventory``, with that command
  line in ``sys.argv`` (where gpufleet reads pyinfra's ``--data``).

A case with ``accept: true`` instead of ``expect`` is input that must be accepted (a dedicated router, say): both
entry points exit 0, in this process, without connecting. ``pyinfra_cli`` is imported once with gevent's
  ``patch_all`` made a no-op (its package would monkey-patch this whole process), and is in ``sys.modules`` only
  while a test runs it: gpufleet's validation behaves as under pyinfra's CLI there, and as outside it elsewhere.

gpufleet's per-process state (the inventories read, ``--data``) and ``sys.argv`` are fresh for each entry point;
they, pyinfra's compiled-file cache and its wrapped ``exec_file``, the working directory and ``sys.path`` are
restored after each test.

A sample that makes every kind of edit between its cases (:data:`EDITS`) also runs as users run it: the real
``gpufleet check`` and the real ``pyinfra`` as subprocesses, each giving the same exit status and line as its
in-process run, which shows that the in-process calls are the path those commands take.

The host is 127.0.0.1 with ``ssh_port`` on a loopback listener the test opens: a case that slipped through would
connect to it under the real ``pyinfra`` (in this process, ``make_inventory`` would return: exit status 0).
"Fast" is the CPU time of each entry point on each case: under MAX_SECONDS in this process; a subprocess also pays
its interpreter's start and imports (1.3 s for pyinfra on a quiet machine, 2.0 s seen while the lab tier used both
cores), so its bound is MAX_SUBPROCESS_SECONDS. A hung subprocess is killed after HANG_SECONDS of wall time: a
bound on hangs, not on speed (the CPU time is that), so it leaves room for the share of the cores the unit tier gets
beside the lab (scripts/run_tiers.py: a quarter of each core a busy vLLM holds). Seen under CI at 30 s: a case killed
after it had printed its line, on its way out.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import io
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

import gpufleet.inventory.load as gpufleet_inventory
from gpufleet.cli.main import main as gpufleet_main
from tests.conftest import DATA
from tests.unit import tls_files
from tests.unit.pyinfra_cli_modules import pyinfra_cli_modules

ROOT = Path(__file__).resolve().parents[3]
CORPUS_DIR = DATA / "corpus"
BIN = Path(sys.executable).parent
BASE_ALL = {
    "vllm_model": "meta-llama/Llama-3.1-8B-Instruct",
    "gpu_profile": "8xH100-SXM",
    "vllm_max_model_len": 8192,
}
HOST = "127.0.0.1"
HANG_SECONDS = 120
MAX_SECONDS = 2.0
MAX_SUBPROCESS_SECONDS = 4.0
INVENTORY = "inventories/fleet.py"
ENV = {"GPUFLEET_CORPUS_VRRP": "corpus-1"}
"""Set for every case (a case's ``env`` adds to it or overrides it)."""


@dataclass
class Run:
    rc: int
    first_line: str
    stderr: str
    seconds: float  # CPU time


WORDS = ("amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "harbor")
TOKENS = {"hf": f"hf_{secrets.token_hex(16)}", "sk": f"sk-{secrets.token_hex(16)}",
          "ghp": f"ghp_{secrets.token_hex(16)}", "plain": secrets.token_hex(16),
          "words": "-".join(secrets.choice(WORDS) for _ in range(4))}
"""What a case's ``<token:KIND>`` stands for: a token of that issuer's shape (``plain``: 32 hex digits of none;
``words``: a key of words, shaped as no credential is), drawn for this run, so that no credential-shaped text is
kept in the corpus."""
_TOKEN = re.compile(r"<token:(\w+)>")


def _drawn(value: Any) -> Any:
    """``value`` with every ``<token:KIND>`` in its text, keys included, replaced by its :data:`TOKENS`."""
    if isinstance(value, str):
        return _TOKEN.sub(lambda m: TOKENS[m[1]], value)
    if isinstance(value, dict):
        return {_drawn(k): _drawn(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_drawn(item) for item in value]
    return value


def load_cases() -> list[dict[str, Any]]:
    """Every case of every corpus file, with its category (the file's stem) and its tokens drawn."""
    cases = []
    for path in sorted(CORPUS_DIR.glob("*.yaml")):
        for case in yaml.safe_load(path.read_text()):
            cases.append({**_drawn(case), "category": path.stem})
    return cases


def case_id(case: dict[str, Any]) -> str:
    return f"{case['category']}/{case['id']}"


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
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() above on Linux, which close() alone does not
        self.sock.close()
        self._thread.join(timeout=5)


def _inventory(case: dict[str, Any], port: int) -> str:
    host_data = {"ssh_port": port, "ssh_user": "root", **(case.get("host") or {})}
    entries = [(HOST, host_data)] + [tuple(h) for h in case.get("hosts") or []]
    body = case.get("groups") or ""
    return ("from gpufleet.inventory.load import apply_group_vars\n"
            f"servers = {entries!r}\n{body}\napply_group_vars(globals())\n{case.get('after') or ''}")


def build_project(case: dict[str, Any], root: Path, port: int) -> list[str]:
    """Write the base project with the case's edit into ``root``; returns the ``--data`` arguments."""
    (root / "inventories").mkdir(parents=True)
    (root / "group_vars").mkdir()
    inventory = root / INVENTORY
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
    if case.get("fifo"):
        target.unlink(missing_ok=True)
        os.mkfifo(target)
    for relative, spec in (case.get("paths") or {}).items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        if spec.endswith("/"):
            path.mkdir(exist_ok=True)
        elif spec.startswith("-> "):
            path.symlink_to(spec.removeprefix("-> "))
        elif spec == "|fifo":
            os.mkfifo(path)
        elif spec == "|private-key":
            path.write_bytes(_throwaway_key())
        elif spec.startswith("|tls:"):
            path.write_text(tls_files.pem(spec.removeprefix("|tls:")))
        else:
            path.write_text(spec)
    return [arg for item in case.get("data") or [] for arg in ("--data", item)]


def _throwaway_key() -> bytes:
    """A private key in PEM, made for this run (no key is kept in the repository)."""
    key = ec.generate_private_key(ec.SECP256R1())
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _first_line(stderr: str) -> str:
    """The first line that is not pyinfra's own progress banner."""
    return next((line for line in stderr.splitlines() if line.strip() and not line.startswith("--> ")), "")


# -- the real commands, as subprocesses -----------------------------------------------------------------

def case_env(case: dict[str, Any]) -> dict[str, str]:
    """The environment variables a case's commands see beside the test's own."""
    return {**ENV, **(case.get("env") or {})}


def run(argv: list[str], cwd: Path, case: dict[str, Any]) -> Run:
    """Run a command; its time is the CPU time it used (user + system, from wait4), which other load on
    the machine does not inflate; a hang is cut at HANG_SECONDS of wall time."""
    env = {**os.environ, **case_env(case), "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
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
    """The case through ``gpufleet check`` and through ``pyinfra -y <inventory> <empty deploy>``, side by side."""
    data = build_project(case, root, port)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        check = pool.submit(run, [str(BIN / "gpufleet"), "check", *data, INVENTORY], root, case)
        pyinfra = pool.submit(run, [str(BIN / "pyinfra"), "-y", *data, INVENTORY, "deploy.py"], root, case)
        return check.result(), pyinfra.result()


# -- the same entry points, in this process -------------------------------------------------------------


def _fresh_process(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    """gpufleet's per-process state as a new process has it, and that process's ``sys.argv``."""
    monkeypatch.setattr(gpufleet_inventory, "_LOADED", {})
    monkeypatch.setattr(gpufleet_inventory, "_BY_FILE", {})
    monkeypatch.setattr(gpufleet_inventory, "_DATA_OVERRIDE", None)
    monkeypatch.setattr(sys, "argv", argv)


def _unexpected(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def check_in_process(root: Path, data: list[str], monkeypatch: pytest.MonkeyPatch) -> Run:
    """``gpufleet check [--data …] inventories/fleet.py`` in ``root``, through click's CliRunner."""
    monkeypatch.chdir(root)
    args = ["check", *data, INVENTORY]
    _fresh_process(monkeypatch, [str(BIN / "gpufleet"), *args])
    start = time.process_time()
    result = CliRunner().invoke(gpufleet_main, args)
    seconds = time.process_time() - start
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += _unexpected(result.exception)
    return Run(result.exit_code, _first_line(stderr), stderr, seconds)


def pyinfra_in_process(root: Path, data: list[str], monkeypatch: pytest.MonkeyPatch) -> Run:
    """What ``pyinfra -y [--data …] inventories/fleet.py deploy.py`` does in ``root`` up to its inventory: run
    the project's config.py (``_set_config``), read ``--data`` (``_set_override_data``), ``make_inventory``."""
    from pyinfra.api.config import Config
    from pyinfra.api.state import State
    from pyinfra.context import ctx_config, ctx_state

    modules = pyinfra_cli_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    cli, cli_inventory, cli_util = (modules[f"pyinfra_cli.{name}"] for name in ("cli", "inventory", "util"))
    monkeypatch.setattr(cli_util, "PYTHON_CODES", {})  # keyed by file name: every case's is inventories/fleet.py
    monkeypatch.setattr(cli_inventory, "exec_file", cli_inventory.exec_file)  # config.py wraps it: undone after
    monkeypatch.chdir(root)
    monkeypatch.setattr(sys, "path", [*sys.path, ".", str(root)])  # pyinfra_cli.main and _setup_state add them
    _fresh_process(monkeypatch, [str(BIN / "pyinfra"), "-y", *data, INVENTORY, "deploy.py"])
    state = State(check_for_changes=False)
    state.cwd = str(root)
    out, err = io.StringIO(), io.StringIO()
    start = time.process_time()
    try:
        with (ctx_state.use(state), ctx_config.use(Config()), contextlib.redirect_stdout(out),
              contextlib.redirect_stderr(err)):
            cli_util.exec_file(str(root / "config.py"))
            override = cli._set_override_data(data[1::2], None, None, None, None, None)  # the KEY=VALUEs
            cli_inventory.make_inventory(INVENTORY, cwd=state.cwd, override_data=override,
                                         group_data_directories=())
        rc = 0
    except SystemExit as exc:
        rc = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:  # noqa: BLE001 - pyinfra would report it and exit 1; the test shows it
        err.write(_unexpected(exc))
        rc = 1
    seconds = time.process_time() - start
    return Run(rc, _first_line(err.getvalue()), err.getvalue(), seconds)


def run_in_process(case: dict[str, Any], root: Path, port: int, monkeypatch: pytest.MonkeyPatch) -> tuple[Run, Run]:
    """The case through ``gpufleet check`` and through pyinfra's inventory loading, in this process."""
    data = build_project(case, root, port)
    for name, value in case_env(case).items():
        monkeypatch.setenv(name, value)
    return check_in_process(root, data, monkeypatch), pyinfra_in_process(root, data, monkeypatch)


def assert_refused(case: dict[str, Any], check: Run, pyinfra: Run, accepted: int,
                   max_seconds: float = MAX_SECONDS) -> None:
    for name, result in (("gpufleet check", check), ("pyinfra", pyinfra)):
        assert (result.rc, result.first_line) == (2, case["expect"]), f"{name}:\n{result.stderr}"
        assert "Traceback" not in result.stderr, f"{name}:\n{result.stderr}"
        if "never_shown" in case:  # a secret the case plants: on no line, not only the first
            assert case["never_shown"] not in result.stderr, name
        assert result.seconds < max_seconds, f"{name} used {result.seconds:.2f} s of CPU"
    assert accepted == 0, "pyinfra connected to the host"


# -- the tests ----------------------------------------------------------------------------------------

CASES = load_cases()
REFUSED = [c for c in CASES if not c.get("accept")]
ACCEPTED = [c for c in CASES if c.get("accept")]
EDITS = ("set", "unset", "raw", "raw_b64", "mkdir", "fifo", "file", "host", "hosts", "groups", "after", "paths",
         "data", "env")
"""The edits a case can make: each is a way its input reaches the commands."""


def _sample(refused: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Refusals that make every edit between them, in corpus order: each next one the case making the most edits
    none before it made (a topic changes the rule that refuses, not the path the input takes to it)."""
    chosen: list[dict[str, Any]] = []
    made: set[str] = set()
    while missing := {edit for case in refused for edit in EDITS if edit in case} - made:
        best = max(refused, key=lambda case: len(missing & set(case)))
        chosen.append(best)
        made |= set(EDITS) & set(best)
    return chosen


SAMPLE = _sample(REFUSED)


def test_corpus_is_large_and_ids_unique() -> None:
    ids = [case_id(c) for c in CASES]
    assert len(ids) >= 200 and len(set(ids)) == len(ids)
    assert all(bool(c.get("expect")) != bool(c.get("accept")) for c in CASES)
    assert {c["category"] for c in REFUSED} == {path.stem for path in CORPUS_DIR.glob("*.yaml")}
    made = {edit for c in CASES for edit in EDITS if edit in c}
    assert {edit for c in SAMPLE for edit in EDITS if edit in c} == made and len(made) >= 12, made


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


@pytest.mark.parametrize("case", ACCEPTED, ids=[case_id(c) for c in ACCEPTED])
def test_good_input_is_accepted(case: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    listener = Listener()
    try:
        check, pyinfra = run_in_process(case, tmp_path / "project", listener.port, monkeypatch)
    finally:
        listener.close()
    for name, result in (("gpufleet check", check), ("pyinfra", pyinfra)):
        assert result.rc == 0 and "Traceback" not in result.stderr, f"{name}:\n{result.stderr}"
    assert listener.accepted == 0


@pytest.mark.parametrize("case", REFUSED, ids=[case_id(c) for c in REFUSED])
def test_bad_input_exits_2_with_its_line_before_any_connection(
        case: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    listener = Listener()
    try:
        check, pyinfra = run_in_process(case, tmp_path / "project", listener.port, monkeypatch)
    finally:
        listener.close()
    assert_refused(case, check, pyinfra, listener.accepted)


@pytest.mark.parametrize("case", SAMPLE, ids=[case_id(c) for c in SAMPLE])
def test_the_real_commands_take_the_same_path(
        case: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real ``gpufleet check`` and ``pyinfra``: refused as in this process, with the same status and line."""
    listener = Listener()
    try:
        check, pyinfra = run_case(case, tmp_path / "subprocess", listener.port)
        in_check, in_pyinfra = run_in_process(case, tmp_path / "in_process", listener.port, monkeypatch)
    finally:
        listener.close()
    assert_refused(case, check, pyinfra, listener.accepted, MAX_SUBPROCESS_SECONDS)
    assert_refused(case, in_check, in_pyinfra, 0)
    assert (in_check.rc, in_check.first_line) == (check.rc, check.first_line), in_check.stderr
    assert (in_pyinfra.rc, in_pyinfra.first_line) == (pyinfra.rc, pyinfra.first_line), in_pyinfra.stderr
