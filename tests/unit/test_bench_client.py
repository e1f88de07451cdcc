"""The bench client's lock and install (gpufleet/bench/client_env.py, ``gpufleet bench-client``): locks as data
(tests/data/bench_client/locks.yaml), the installed client as ``gpufleet bench`` finds it (stamps.yaml: each refusal
is one line, exit 2, before any host), pip's failures in one line (pip_outputs.yaml), the lock gpufleet ships, and
an install from a lock of one small wheel, offline, that pip refuses once the wheel is not the one pinned."""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from gpufleet_lab.wheelhouse import ABI, EXTRA_REQUIREMENTS, PLATFORMS

from gpufleet.bench import client_env
from gpufleet.bench import guidellm_client as client
from gpufleet.cli import bench as cli_bench
from gpufleet.cli.main import main
from gpufleet.digest import file_sha256
from tests.conftest import DATA

CASES = DATA / "bench_client"
LOCKS = yaml.safe_load((CASES / "locks.yaml").read_text())
STAMPS = yaml.safe_load((CASES / "stamps.yaml").read_text())
PIP_OUTPUTS = yaml.safe_load((CASES / "pip_outputs.yaml").read_text())
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


def test_a_given_client_must_be_an_executable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``GPUFLEET_GUIDELLM`` names a guidellm the operator answers for: said, not checked against the lock; one
    that is no executable is refused like a missing client."""
    monkeypatch.setattr(cli_bench, "read", _never)
    monkeypatch.setattr(client, "run_step", _never)
    monkeypatch.setenv(client.CLIENT_ENV, str(tmp_path / "guidellm"))
    result = CliRunner().invoke(main, ["bench", FLEET], prog_name="gpufleet")
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"gpufleet bench: {client.CLIENT_ENV}: expected a guidellm executable, found '{tmp_path / 'guidellm'}'"]
    said: list[str] = []
    (tmp_path / "guidellm").write_text("#!/bin/sh\n")
    (tmp_path / "guidellm").chmod(0o755)
    assert client.client_path(said.append) == tmp_path / "guidellm"
    assert said == [f"the client is {client.CLIENT_ENV}'s {tmp_path / 'guidellm'} (not checked against gpufleet's"
                    " lock)"]


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


@pytest.mark.parametrize(("args", "lock_text", "expect"), [
    (["--wheelhouse", "{tmp}/none"], None, "--wheelhouse: expected a directory of wheels, found '{tmp}/none'"),
    (["--wheelhouse", "{tmp}", "--download", "{tmp}/w"], None, "--download: expected no --wheelhouse with it (it"
                                                                " fills one)"),
    ([], f"# target: cp311-manylinux_2_36_x86_64\nguidellm==0.8.1 --hash=sha256:{H}\ntorch==2.13.0+cpu\n",
     "requirements-0.8.1.lock: line 3: expected name==version --hash=sha256:<64 hex digits>, found"
     " 'torch==2.13.0+cpu'"),
    ([], "", "requirements-0.8.1.lock: expected a '# target: cp3XX-manylinux_2_NN_ARCH' line, found none"),
], ids=["wheelhouse-missing", "download-and-wheelhouse", "an-unhashed-pin-in-the-lock", "an-empty-lock"])
def test_bench_client_refuses_bad_input_in_one_line(args: list[str], lock_text: str | None, expect: str,
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(client_env, "install", _never)
    monkeypatch.setattr(client_env, "download", _never)
    if lock_text is not None:
        monkeypatch.setattr(client_env, "LOCK_DIR", tmp_path)
        client_env.lock_path(client.VERSION).write_text(lock_text)
    result = CliRunner().invoke(main, ["bench-client", *(a.replace("{tmp}", str(tmp_path)) for a in args)],
                                prog_name="gpufleet")
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"gpufleet bench-client: {expect.replace('{tmp}', str(tmp_path))}"]


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
    leaves no stamp."""
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
    with pytest.raises(client_env.InstallError) as failed:
        client_env.install(venv, lock, "guidellm", wheelhouse=str(wheels))
    assert str(failed.value) == (f"pip install -r {lock.name} failed (exit 1): not the wheel the lock pins (its sha256"
                                 f" differs): gpufleet-test-client==1.0 ({wheel.as_uri()})")
    assert client_env.check(venv, lock, "guidellm") == (f"the bench client is not installed in {venv}: install it"
                                                        f" with {client_env.INSTALL_COMMAND}")
