"""Role node_exporter with host tools: its rendered unit rated by ``systemd-analyze security --offline``, and the
lab's tarball repackaged from a stand-in for Debian's .deb, which dpkg-deb builds. The rest of the role:
tests/unit/roles/test_node_exporter.py.
"""

from __future__ import annotations

import gzip
import hashlib
import subprocess
import tarfile
from pathlib import Path

import pytest
from gpufleet_lab import debian_extras

from gpufleet.units.security import exposure_score
from roles import node_exporter as role
from tests.conftest import host_tool
from tests.unit.configs import config_problems, https_host_config

# The exposure the lab test holds the unit to (tests/lab/test_monitoring.py explains the number).
EXPOSURE_BOUND = 2.0

# --- what it renders, as systemd rates it --------------------------------------------------------------------------

def test_rendered_unit_scores_within_the_bound_offline(tmp_path: Path) -> None:
    host_tool("systemd-analyze", "systemd")
    unit = tmp_path / "node_exporter.service"
    unit.write_text(role.render(https_host_config(), "10.0.0.5"))
    done = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
                          capture_output=True, text=True)
    assert exposure_score(done.stdout) <= EXPOSURE_BOUND, done.stdout


# --- the lab's repackaged tarball ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fake_deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stand-in for Debian's prometheus-node-exporter .deb: its control fields, binary and docs."""
    host_tool("dpkg-deb", "dpkg")
    root = tmp_path_factory.mktemp("deb") / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN/control").write_text(
        "Package: prometheus-node-exporter\nVersion: 1.5.0-1+b6\nArchitecture: amd64\n"
        "Maintainer: test <t@example.invalid>\nDescription: test\n"
    )
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/prometheus-node-exporter").write_bytes(b"\x7fELF debian build")
    doc = root / "usr/share/doc/prometheus-node-exporter"
    doc.mkdir(parents=True)
    (doc / "NOTICE").write_text("node_exporter notice\n")
    (doc / "copyright").write_text("Apache-2.0\n")
    deb = root.parent / "prometheus-node-exporter_1.5.0-1+b6_amd64.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(deb)], check=True, capture_output=True)
    return deb


def test_lab_tarball_has_the_upstream_layout_and_says_it_is_a_repackaging(fake_deb: Path, tmp_path: Path) -> None:
    built = debian_extras.build_node_exporter_tarball(fake_deb, tmp_path / "node_exporter")
    assert built.version == "1.5.0"
    assert built.path == tmp_path / "node_exporter/v1.5.0/node_exporter-1.5.0.linux-amd64.tar.gz"
    assert built.relative_url == "node_exporter/v1.5.0/node_exporter-1.5.0.linux-amd64.tar.gz"
    with tarfile.open(built.path) as tar:
        names = {m.name: m for m in tar.getmembers()}
        stem = "node_exporter-1.5.0.linux-amd64"
        assert set(names) == {stem, f"{stem}/node_exporter", f"{stem}/NOTICE", f"{stem}/copyright",
                              f"{stem}/LAB-REPACKAGED"}
        assert names[stem].isdir() and names[f"{stem}/node_exporter"].mode == 0o755
        binary = tar.extractfile(f"{stem}/node_exporter")
        note = tar.extractfile(f"{stem}/LAB-REPACKAGED")
        assert binary is not None and binary.read() == b"\x7fELF debian build"
        assert note is not None and b"not a node_exporter release" in note.read()
    sums = (built.path.parent / "sha256sums.txt").read_text()
    assert sums == f"{hashlib.sha256(built.path.read_bytes()).hexdigest()}  {built.path.name}\n"
    assert debian_extras.built_tarball(tmp_path / "node_exporter") == built
    assert role.binary_sha256(built.path) == hashlib.sha256(b"\x7fELF debian build").hexdigest()


def test_lab_tarball_is_reproducible(fake_deb: Path, tmp_path: Path) -> None:
    first = debian_extras.build_node_exporter_tarball(fake_deb, tmp_path / "a")
    second = debian_extras.build_node_exporter_tarball(fake_deb, tmp_path / "b")
    assert first.sha256 == second.sha256
    assert gzip.decompress(first.path.read_bytes()) == gzip.decompress(second.path.read_bytes())


def test_lab_inventory_data_points_at_the_mirror(fake_deb: Path, tmp_path: Path) -> None:
    from gpufleet_lab.mirror import node_exporter_sources

    assert "node_exporter_tarball_sha256" not in node_exporter_sources("http://10.9.0.1:8080/", tmp_path)
    built = debian_extras.build_node_exporter_tarball(fake_deb, tmp_path / "www/node_exporter")
    data = node_exporter_sources("http://10.9.0.1:8080/", tmp_path)
    assert data["node_exporter_tarball_sha256"] == built.sha256
    assert data["node_exporter_tarball_url"] == (
        "http://10.9.0.1:8080/node_exporter/v{version}/node_exporter-{version}.linux-amd64.tar.gz"
    )
    assert data["node_exporter_apt_source"] == (
        "deb [signed-by=/usr/share/keyrings/gpufleet-lab.gpg] http://10.9.0.1:8080/debian/ /"
    )
    assert data["node_exporter_apt_keyring"] == str(tmp_path / "www/keys/gpufleet-lab.gpg")
    assert config_problems(**data, node_exporter_version="1.5.0", allow_plain_http=True) == []
