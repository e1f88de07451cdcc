"""Roles dcgm_exporter and nvidia_driver with host tools: the counters file served by the exporter double against
the NVML simulator (which gcc builds), and the repository key pinned by its fingerprint, with keys gpg makes. Their
templates, pins, counters and decisions: tests/unit/roles/test_roles_provision.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from gpufleet_lab import nvml_sim, sim_profile
from gpufleet_lab.double_programs import dcgm_exporter as exporter_double

from gpufleet.facts.nvidia import KeyFingerprints
from gpufleet.operations.nvidia import fetch_key_script
from gpufleet.templates import render
from tests.conftest import host_tool
from tests.loopback_http import free_port, http_get
from tests.polling import wait_for_port
from tests.unit.nvidia_driver_defaults import DEFAULTS

# --- dcgm_exporter: the counters, served from the simulator ------------------------------------------------

def test_exporter_double_serves_every_counter_from_the_simulator(tmp_path: Path) -> None:
    """The rendered counters, served by the exporter double on a simulated HGX H100: every field appears, the
    ones the simulator has no entry point for (violations) as 0, as are a healthy node's XIDs and NVLink errors."""
    host_tool("gcc", "gcc")
    library = nvml_sim.build_library(tmp_path / "lib")
    facts = sim_profile.write_sim_profile(tmp_path / "profile", "8xH100-SXM", ["pending_row_remap"], hostname="n1")
    counters = tmp_path / "counters.csv"
    counters.write_text(render("dcgm_exporter/counters.csv.j2", nvlink=True))
    engine_port, port = free_port(), free_port()
    programs = Path(exporter_double.__file__).parent
    engine = subprocess.Popen([sys.executable, str(programs / "nv_hostengine.py"), "-n", "-p", str(engine_port)])
    exporter = subprocess.Popen(
        [sys.executable, str(programs / "dcgm_exporter.py"), "-f", str(counters), "-a", f"127.0.0.1:{port}",
         "-r", f"127.0.0.1:{engine_port}"],
        env=nvml_sim.sim_environ(library, tmp_path / "profile"), stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for_port(port)
        text = http_get(f"http://127.0.0.1:{port}/metrics").decode()
    finally:
        exporter.terminate()
        engine.terminate()
        _, stderr = exporter.communicate(timeout=10)
        engine.wait(timeout=10)
    values: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("DCGM_"):
            values.setdefault(line.split("{", 1)[0], []).append(line.rsplit(" ", 1)[1])
    metrics = {field for field, kind, _ in exporter_double.read_counters(str(counters)) if kind != "label"}
    assert set(values) == metrics, stderr
    assert all(len(v) == len(facts.gpus) for v in values.values())
    for zero in ("DCGM_FI_DEV_XID_ERRORS", "DCGM_EXP_XID_ERRORS_COUNT", "DCGM_FI_DEV_POWER_VIOLATION",
                 "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"):
        assert values[zero] == ["0"] * len(facts.gpus), zero
    assert values["DCGM_FI_DEV_ROW_REMAP_PENDING"][0] == "1"  # what the simulator does answer comes through
    assert values["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"] == ["1"] * len(facts.gpus)  # gpu_idle
    assert f'Hostname="{socket.gethostname()}",DCGM_FI_DRIVER_VERSION="{facts.driver_version}"' in text


# --- nvidia_driver: the repository key is pinned by fingerprint ----------------------------------------------

def _gpg_key(home: Path, uid: str) -> tuple[Path, str]:
    """A fresh ed25519 signing key in ``home``: its exported public keyring and its fingerprint."""
    home.mkdir(mode=0o700)
    gpg = ["gpg", "--homedir", str(home), "--batch", "--pinentry-mode", "loopback", "--passphrase", ""]
    subprocess.run([*gpg, "--quick-generate-key", uid, "ed25519", "sign", "never"], check=True, capture_output=True)
    listing = subprocess.run([*gpg, "--with-colons", "--list-keys"], check=True, capture_output=True, text=True)
    fingerprint = next(line.split(":")[9] for line in listing.stdout.splitlines() if line.startswith("fpr:"))
    keyring = home.parent / f"{home.name}.gpg"
    keyring.write_bytes(subprocess.run([*gpg, "--export", fingerprint], check=True, capture_output=True).stdout)
    subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "gpg-agent"], capture_output=True)
    return keyring, fingerprint


@pytest.fixture(scope="module")
def two_keys(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, str]]:
    host_tool("gpg", "gnupg")
    base = tmp_path_factory.mktemp("keys")
    return [_gpg_key(base / "good", "good <good@gpufleet.invalid>"),
            _gpg_key(base / "bad", "bad <bad@gpufleet.invalid>")]


def _sh(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60)


def test_a_key_with_the_pinned_fingerprint_is_installed(two_keys: list[tuple[Path, str]], tmp_path: Path) -> None:
    (keyring, fingerprint), _ = two_keys
    dest = tmp_path / "gpufleet-nvidia.gpg"
    done = _sh(fetch_key_script(keyring.as_uri(), str(dest), fingerprint))
    assert done.returncode == 0, done.stderr
    assert dest.read_bytes() == keyring.read_bytes()
    # the fact reads the installed keyring back: the operation has nothing left to do
    assert KeyFingerprints().process(_sh(KeyFingerprints().command(str(dest))).stdout.splitlines()) == [fingerprint]
    assert KeyFingerprints().process(_sh(KeyFingerprints().command(str(tmp_path / "absent"))).stdout.splitlines()) == []


def test_a_key_with_another_fingerprint_stops_the_node_and_is_not_trusted(
    two_keys: list[tuple[Path, str]], tmp_path: Path
) -> None:
    (good, fingerprint), (bad, other) = two_keys
    dest = tmp_path / "gpufleet-nvidia.gpg"
    dest.write_bytes(good.read_bytes())  # trusted before: a wrong key replaces nothing, and goes
    done = _sh(fetch_key_script(bad.as_uri(), str(dest), fingerprint))
    assert done.returncode != 0
    assert f"has fingerprint(s) {other}, expected {fingerprint} (nvidia_repo_key_fingerprint): not trusted" \
        in done.stderr, done.stderr
    assert not dest.exists()
    # NVIDIA's published fingerprint is the default; a keyring of two keys is not "the" key either
    assert DEFAULTS["nvidia_repo_key_fingerprint"] == "EB693B3035CD5710E231E123A4B469963BF863CC"
    both = tmp_path / "both.gpg"
    both.write_bytes(good.read_bytes() + bad.read_bytes())
    assert _sh(fetch_key_script(both.as_uri(), str(dest), fingerprint)).returncode != 0 and not dest.exists()
