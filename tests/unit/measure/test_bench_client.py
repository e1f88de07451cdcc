"""The bench client's lock and install (gpufleet/measure/client_env.py, ``gpufleet bench-client``): locks as data
(tests/data/bench_client/locks.yaml), the installed client as ``gpufleet bench`` finds it (stamps.yaml: each refusal
is one line, exit 2, before any host), a client the operator names (given_clients.yaml), pip's failures in one line
(pip_outputs.yaml), ``gpufleet bench-client``'s refusals of bad input (refusals.yaml) and its installs over a client
already there (reinstalls.yaml: a failed one leaves it as it was), the lock gpufleet ships, and an install from a
lock of one small wheel, offline, that pip refuses once the wheel is not the one pinned."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from gpufleet_lab.wheelhouse import ABI, EXTRA_REQUIREMENTS, PLATFORMS

from gpufleet.cli import bench as cli_bench
from gpufleet.cli.main import main
from gpufleet.digest import file_sha256
from gpufleet.measure import client_env
from gpufleet.measure import guidellm_client as client
from tests.conftest import DATA

CASES = DATA / "bench_client"
LOCKS = yaml.safe_load((CASES / "locks.yaml").read_text())
STAMPS = yaml.safe_load((CASES / "stamps.yaml").read_text())
PIP_OUTPUTS = yaml.safe_load((CASES / "pip_outputs.yaml").read_text())
REFUSALS = yaml.safe_load((CASES / "refusals.yaml").read_text())
REINSTALLS = yaml.safe_load((CASES / "reinstalls.yaml").read_text())
GIVEN_CLIENTS = yaml.safe_load((CASES / "given_clients.yaml").read_text())
FLEET = str(DATA / "rollout_fleet" / "inventory.py")
H, OTHER_H = "a" * 64, "b" * 64


def _never(*args: object, **kwargs: object) -> Any:
    raise AssertionError("a refused client must not reach a host or pip")


@pytest.mark.parametrize("case", LOCKS, ids=[c["id"] for c in LOCKS])
def test_a_lock_is_exact_pins_with_their_sha256_and_a_target(case: dict[str, Any]) -> None:
    text = case["text"].replace("{h}", H).replace("{H}", OTHER_H)
    if "expect" in case:
        with pytest.raises(client_env.LockError) as refused:
            client_env.parse_lock(text, "test.lock")
        assert str(refused.value) == case["expect"].replace("{h}", H)
        return
    lock = client_env.parse_lock(text, "test.lock")
    assert lock.target == case["target"]
    assert [f"{p.name}=={p.version}" for p in lock.pins] == case["pins"]
    assert all(len(p.hashes) == case.get("hashes", 1) for p in lock.pins)


def test_the_shipped_lock_pins_guidellm_and_the_labs_torch_for_the_labs_target() -> None:
    """The lock gpufleet ships: guidellm at the version the bench drives, the CPU build of torch the lab's
    wheelhouse holds, for the lab's (and its controller's) interpreter and platform, whose tags are the lab's."""
    path = client_env.lock_path(client.VERSION)
    lock = client_env.read_lock(path)
    torch = next(r for r in EXTRA_REQUIREMENTS if r.startswith("torch=="))
    assert lock.target == f"{ABI}-{PLATFORMS[0]}" and lock.python == "3.11"
    pinned = {f"{p.name}=={p.version}" for p in lock.pins}
    assert {f"guidellm=={client.VERSION}", torch} <= pinned
    assert [p.name for p in lock.pins] == sorted(p.name for p in lock.pins)
    assert all(len(p.hashes) == 1 for p in lock.pins)
    args = client_env.target_args(lock.target)
    assert [args[i + 1] for i, a in enumerate(args) if a == "--platform"] == list(PLATFORMS)
    assert "make bench-client-lock" in path.read_text().splitlines()[1]


def test_an_interpreter_other_than_the_targets_is_named() -> None:
    problem = client_env.interpreter_problem("cp399-manylinux_2_36_x86_64")
    assert problem is not None
    assert problem.startswith("the lock's wheels are for CPython 3.99 on Linux x86_64 (cp399-manylinux_2_36_x86_64),"
                              f" this is cpython 3.{sys.version_info.minor} on ")


def _client_as_found(case: dict[str, Any], cache: Path, lock: Path) -> Path:
    """The client's environment of ``case`` under ``cache`` (``$XDG_CACHE_HOME``), checked against ``lock``."""
    venv = cache / "gpufleet" / f"guidellm-{client.VERSION}"
    if case.get("venv", True):
        (venv / "bin").mkdir(parents=True)
        if case.get("executable", True):
            (venv / "bin" / "guidellm").write_text("#!/bin/sh\n")
            (venv / "bin" / "guidellm").chmod(0o755)
        if "stamp" in case:
            (venv / client_env.STAMP).write_text(case["stamp"].replace("{lock_sha256}", file_sha256(lock)))
    return venv


def _expected(case: dict[str, Any], venv: Path, lock: Path) -> str:
    return str(case["expect"]).replace("{venv}", str(venv)).replace("{lock_sha12}", file_sha256(lock)[:12])


@pytest.mark.parametrize("case", STAMPS, ids=[c["id"] for c in STAMPS])
def test_the_client_is_the_one_installed_from_the_lock(case: dict[str, Any], tmp_path: Path) -> None:
    lock = client_env.lock_path(client.VERSION)
    venv = _client_as_found(case, tmp_path, lock)
    found = client_env.check(venv, lock, "guidellm")
    assert found == (_expected(case, venv, lock) if "expect" in case else None)


@pytest.mark.parametrize("case", [c for c in STAMPS if "expect" in c], ids=[c["id"] for c in STAMPS if "expect" in c])
def test_the_bench_refuses_a_missing_or_mismatched_client_in_one_line_before_any_host(
        case: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = client_env.lock_path(client.VERSION)
    venv = _client_as_found(case, tmp_path, lock)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(client.CLIENT_ENV, raising=False)
    monkeypatch.setattr(cli_bench, "read", _never)
    monkeypatch.setattr(client, "run_step", _never)
    monkeypatch.setattr(client_env, "install", _never)
    result = CliRunner().invoke(main, ["bench", FLEET], prog_name="gpufleet")
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"gpufleet bench: {_expected(case, venv, lock)}"]


def _report_writer(path: Path) -> None:
    """A guidellm that writes a report of one benchmark into its working directory, as ``run_step`` reads it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"benchmarks": [{"duration": 1.0, "metrics": {"request_totals": {"successful": 1}}}]}
    path.write_text(f"#!/bin/sh\nprintf '%s' '{json.dumps(report)}' > report.json\n")
    path.chmod(0o755)


@pytest.mark.parametrize("case", GIVEN_CLIENTS, ids=[c["id"] for c in GIVEN_CLIENTS])
def test_a_given_client_is_an_executable_run_by_its_absolute_path(
        case: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``GPUFLEET_GUIDELLM`` names a guidellm the operator answers for: said, not checked against the lock, and run
    by its absolute path (each step runs in a directory of its own); one that is no executable is refused like a
    missing client."""
    def at(text: str) -> str:
        return text.replace("{tmp}", str(tmp_path))

    if "executable" in case:
        _report_writer(tmp_path / case["executable"])
    Path(at(case["cwd"])).mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(at(case["cwd"]))
    monkeypatch.setenv(client.CLIENT_ENV, at(case["env"]))
    if "expect" in case:
        monkeypatch.setattr(cli_bench, "read", _never)
        monkeypatch.setattr(client, "run_step", _never)
        result = CliRunner().invoke(main, ["bench", FLEET], prog_name="gpufleet")
        assert result.exit_code == 2, result.output
        assert result.stderr.splitlines() == [f"gpufleet bench: {at(case['expect'])}"]
        return
    said: list[str] = []
    found = client.client_path(said.append)
    assert found == Path(at(case["path"])) and found.is_absolute()
    assert said == [f"the client is {client.CLIENT_ENV}'s {found} (not checked against gpufleet's lock)"]
    target = client.Target("http://127.0.0.1:9", "m", None, None, "tok")
    assert client.run_step(found, target, client.Workload(), 1.0, 5.0).succeeded == 1


@pytest.mark.parametrize("case", PIP_OUTPUTS, ids=[c["id"] for c in PIP_OUTPUTS])
def test_a_failed_pip_is_one_line(case: dict[str, Any]) -> None:
    assert client_env.output_problem(case["output"]) == case["expect"]


def test_bench_client_leaves_a_client_installed_from_the_lock_as_it_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = client_env.lock_path(client.VERSION)
    venv = _client_as_found(STAMPS[0], tmp_path, lock)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(client_env, "interpreter_problem", lambda target: None)
    monkeypatch.setattr(client_env, "install", _never)
    result = CliRunner().invoke(main, ["bench-client"], prog_name="gpufleet")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        f"gpufleet bench-client: guidellm {client.VERSION} in {venv} is installed from {lock.name}"]


def _make(tmp_path: Path, made: dict[str, str]) -> None:
    for name, kind in made.items():
        path = tmp_path / name
        if kind == "dir":
            path.mkdir(parents=True)
        elif kind == "file":
            path.write_text("")
        elif kind == "fifo":
            os.mkfifo(path)
        else:
            path.symlink_to(kind.removeprefix("symlink "))


@pytest.mark.parametrize("case", REFUSALS, ids=[c["id"] for c in REFUSALS])
def test_bench_client_refuses_bad_input_in_one_line(case: dict[str, Any], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def at(text: str) -> str:
        return text.replace("{tmp}", str(tmp_path))

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(client.WHEELHOUSE_ENV, raising=False)
    for name, value in (case.get("env") or {}).items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, at(value))
    monkeypatch.setattr(client_env, "install", _never)
    monkeypatch.setattr(client_env, "download", _never)
    monkeypatch.setattr(client_env, "interpreter_problem", lambda target: None)
    monkeypatch.chdir(tmp_path)
    if "lock" in case:
        monkeypatch.setattr(client_env, "LOCK_DIR", tmp_path)
        client_env.lock_path(client.VERSION).write_text(case["lock"])
    _make(tmp_path, case.get("make") or {})
    made = sorted(tmp_path.rglob("*"))
    result = CliRunner().invoke(main, ["bench-client", *(at(a) for a in case.get("args", []))], prog_name="gpufleet")
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.splitlines() == [f"gpufleet bench-client: {at(case['expect'])}"]
    assert sorted(tmp_path.rglob("*")) == made


_STEP_FAILURES = {
    "venv": "Error: [Errno 28] No space left on device\n",
    "pip": ("ERROR: Could not find a version that satisfies the requirement aiofiles==25.1.0 (from versions: none)\n"
            "ERROR: No matching distribution found for aiofiles==25.1.0\n"),
    "help": "Traceback (most recent call last):\nModuleNotFoundError: No module named 'torch'\n",
}
_NEW_CLIENT = "#!/bin/sh\n# new\n"


def _steps(fails: str | None) -> Any:
    """subprocess.run as the install's steps: python -m venv, pip and guidellm --help each make their part of the
    environment (a new bin/guidellm), and the one named ``fails`` fails after it."""
    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if argv[1:3] == ["-m", "venv"]:
            step, venv = "venv", Path(argv[3])
            (venv / "bin").mkdir(parents=True)
            (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
        elif argv[1:3] == ["-m", "pip"]:
            step, venv = "pip", Path(argv[0]).parents[1]
            (venv / "bin" / "guidellm").write_text(_NEW_CLIENT)
            (venv / "bin" / "guidellm").chmod(0o755)
        else:
            assert argv[1:] == ["--help"], argv
            step = "help"
        return subprocess.CompletedProcess(argv, 1 if step == fails else 0, "",
                                           _STEP_FAILURES[step] if step == fails else "")
    return run


@pytest.mark.parametrize("case", REINSTALLS, ids=[c["id"] for c in REINSTALLS])
def test_a_failed_install_leaves_the_client_there_as_it_was(case: dict[str, Any], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    lock = client_env.lock_path(client.VERSION)
    venv = tmp_path / "gpufleet" / f"guidellm-{client.VERSION}"
    aside = client_env.previous_path(venv)
    previous = ""
    if case["before"] == "stamped":
        _client_as_found(STAMPS[0], tmp_path, lock)
        previous = (venv / client_env.STAMP).read_text()
    if "left" in case:
        venv.rename(aside)
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "guidellm").write_text(_NEW_CLIENT)
        (venv / "bin" / "guidellm").chmod(0o755)
        if case["left"] == "stamped":
            (venv / client_env.STAMP).write_text(client_env.stamp_text(lock))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(client.WHEELHOUSE_ENV, raising=False)
    monkeypatch.setattr(client_env, "interpreter_problem", lambda target: None)
    monkeypatch.setattr(subprocess, "run", _steps(case.get("fails")))
    result = CliRunner().invoke(main, ["bench-client", *case.get("args", ["--force"])], prog_name="gpufleet")
    assert result.exit_code == case["exit"], result.output

    def lines(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.endswith(" s)")] + [
            line.rsplit(" (", 1)[0] for line in text.splitlines() if line.endswith(" s)")]

    assert lines(result.stdout) == [f"gpufleet bench-client: {line.replace('{venv}', str(venv))}"
                                    for line in case.get("stdout", [])]
    assert result.stderr.splitlines() == [f"gpufleet bench-client: {line.replace('{venv}', str(venv))}"
                                          for line in case.get("stderr", [])]
    assert not os.path.lexists(aside)
    if case["client"] == "none":
        assert not os.path.lexists(venv)
        return
    assert client_env.check(venv, lock, "guidellm") is None
    if case["client"] == "previous":
        assert (venv / "bin" / "guidellm").read_text() == "#!/bin/sh\n"
        assert (venv / client_env.STAMP).read_text() == previous
    else:
        assert (venv / "bin" / "guidellm").read_text() == _NEW_CLIENT
        assert (venv / client_env.STAMP).read_text() == client_env.stamp_text(lock)


def _small_client_wheel(folder: Path) -> Path:
    """A wheel of one module whose console script ``guidellm`` exits 0."""
    dist = "gpufleet_test_client-1.0.dist-info"
    files = {
        "gpufleet_test_client.py": "def main():\n    raise SystemExit(0)\n",
        f"{dist}/METADATA": "Metadata-Version: 2.1\nName: gpufleet-test-client\nVersion: 1.0\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist}/entry_points.txt": "[console_scripts]\nguidellm = gpufleet_test_client:main\n",
    }
    digest = {path: base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
              for path, text in files.items()}
    files[f"{dist}/RECORD"] = "".join(f"{p},sha256={digest[p]},{len(t.encode())}\n" for p, t in files.items()) + (
        f"{dist}/RECORD,,\n")
    wheel = folder / "gpufleet_test_client-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(zipfile.ZipInfo(path, date_time=(1980, 1, 1, 0, 0, 0)), text)
    return wheel


def test_an_install_is_the_locks_wheels_offline_and_a_wheel_not_pinned_is_refused(tmp_path: Path) -> None:
    """The real install, offline from a wheelhouse: the environment is stamped with the lock's digest and passes
    the bench's check; the same lock over a wheel that is not the one it pins fails in pip, one line naming it, and
    leaves the client installed before it as it was (it runs, with its stamp)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = _small_client_wheel(wheels)
    lock = tmp_path / "requirements-1.0.lock"
    lock.write_text(f"# target: cp311-manylinux_2_36_x86_64\ngpufleet-test-client==1.0 --hash=sha256:"
                    f"{file_sha256(wheel)}\n")
    venv = tmp_path / "cache" / "guidellm-1.0"
    client_env.install(venv, lock, "guidellm", wheelhouse=str(wheels))
    assert client_env.check(venv, lock, "guidellm") is None
    assert json.loads((venv / client_env.STAMP).read_text()) == {"lock": lock.name, "sha256": file_sha256(lock)}
    with zipfile.ZipFile(wheel, "a") as zf:
        zf.writestr("gpufleet_test_client_extra.py", "")
    stamp = (venv / client_env.STAMP).read_text()
    with pytest.raises(client_env.InstallError) as failed:
        client_env.install(venv, lock, "guidellm", wheelhouse=str(wheels))
    assert str(failed.value) == (f"pip install -r {lock.name} failed (exit 1): not the wheel the lock pins (its sha256"
                                 f" differs): gpufleet-test-client==1.0 ({wheel.as_uri()})")
    assert client_env.check(venv, lock, "guidellm") is None
    assert (venv / client_env.STAMP).read_text() == stamp
    assert sorted(p.name for p in venv.parent.iterdir()) == [venv.name]
    assert subprocess.run([venv / "bin" / "guidellm", "--help"], check=False).returncode == 0
