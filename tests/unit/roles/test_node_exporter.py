"""Role node_exporter without a node: its variables, the unit and drop-in it renders, the controller's sha256
check of the release tarball, how the lab reads Debian's packages, and the exposure-score parser of
``systemd-analyze security``. The unit rated by systemd-analyze and the lab's repackaged tarball (dpkg-deb):
tests/tools/test_node_exporter.py.

No network: tarballs are fetched from ``file://`` URLs in temporary directories.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest
from gpufleet_lab import debian_extras
from gpufleet_lab.errors import LabError

from gpufleet.downloads import DownloadError, fetch_verified
from gpufleet.units.security import ExposureParseError, exposure, exposure_score, node_report
from roles import node_exporter as role
from tests.unit.configs import config_problems, https_host_config

UPSTREAM_1_9_1_AMD64 = "becb950ee80daa8ae7331d77966d94a611af79ad0d3307380907e0ec08f5b4e8"


def _service_lines(text: str) -> list[str]:
    """The directives of a unit file (comments and blank lines dropped, continuation lines joined)."""
    joined = text.replace("\\\n", " ")
    return [" ".join(line.split()) for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


# --- variables ---------------------------------------------------------------------------------------------------

def test_defaults_install_the_pinned_upstream_tarball() -> None:
    cfg = https_host_config()
    assert cfg.node_exporter_install == "tarball"
    assert role.tarball_url(cfg) == (
        "https://github.com/prometheus/node_exporter/releases/download/v1.9.1/node_exporter-1.9.1.linux-amd64.tar.gz"
    )
    assert cfg.node_exporter_tarball_sha256 == UPSTREAM_1_9_1_AMD64
    assert cfg.node_exporter_listen_address is None and cfg.node_exporter_apt_source is None


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"node_exporter_install": "docker"},
         "node_exporter_install: expected one of tarball, package, found 'docker'"),
        ({"node_exporter_tarball_sha256": "abc"}, "node_exporter_tarball_sha256: expected text matching"),
        ({"node_exporter_tarball_url": "ftp://x/y.tgz"}, "node_exporter_tarball_url: expected a URL"),
        ({"node_exporter_apt_source": "deb http://mirror/debian bookworm main"},
         "node_exporter_apt_source: expected text"),
        ({"node_exporter_listen_address": "node1.example"}, "node_exporter_listen_address: expected an IP address"),
    ],
)
def test_bad_values_are_one_line_problems(values: dict[str, object], expected: str) -> None:
    found = config_problems(**values)
    assert len(found) == 1 and expected in found[0], found


def test_an_apt_source_must_name_its_keyring() -> None:
    source = "deb [arch=amd64 signed-by=/usr/share/keyrings/site.gpg] http://mirror.example/debian/ /"
    assert config_problems(node_exporter_apt_source=source, allow_plain_http=True) == []
    assert role.signed_by(source) == "/usr/share/keyrings/site.gpg"
    assert role.signed_by("deb [signed-by=/k.gpg] http://m/ bookworm main") == "/k.gpg"


# --- what it renders -----------------------------------------------------------------------------------------------

def test_listens_on_the_fleet_address_unless_told_otherwise() -> None:
    assert role.listen_address(https_host_config(), "10.0.0.5") == "10.0.0.5:9100"
    assert role.listen_address(https_host_config(fleet_address="10.40.0.11"), "gpu-a01") == "10.40.0.11:9100"
    told = https_host_config(node_exporter_listen_address="0.0.0.0", node_exporter_port=9200)
    assert role.listen_address(told, "h") == "0.0.0.0:9200"
    assert role.listen_address(https_host_config(fleet_address="fd00::11"), "h") == "[fd00::11]:9100"


def test_tarball_unit_runs_our_binary_as_its_own_user_with_both_collectors() -> None:
    text = role.render(https_host_config(fleet_address="10.40.0.11"), "gpu-a01")
    lines = _service_lines(text)
    assert "User=node_exporter" in lines and "Group=node_exporter" in lines
    (exec_start,) = [line for line in lines if line.startswith("ExecStart=")]
    assert exec_start.split() == [
        "ExecStart=/usr/local/bin/node_exporter",
        "--web.listen-address=10.40.0.11:9100",
        "--collector.systemd",
        "--collector.systemd.enable-restarts-metrics",
        "--collector.textfile.directory=/var/lib/node_exporter/textfile_collector",
    ]
    assert "WantedBy=multi-user.target" in lines
    assert text.startswith("# Managed by gpufleet")


def test_both_units_carry_the_sandbox() -> None:
    for install in ("tarball", "package"):
        lines = _service_lines(role.render(https_host_config(node_exporter_install=install), "10.0.0.5"))
        for directive in (
            "NoNewPrivileges=yes", "CapabilityBoundingSet=", "AmbientCapabilities=", "ProtectSystem=strict",
            "ProtectHome=read-only", "PrivateTmp=yes", "PrivateDevices=yes", "ProtectKernelTunables=yes",
            "ProtectKernelModules=yes", "ProtectKernelLogs=yes", "ProtectControlGroups=yes", "PrivateUsers=yes",
            "SystemCallFilter=@system-service", "SystemCallArchitectures=native", "RestrictNamespaces=yes",
            "MemoryDenyWriteExecute=yes", "UMask=0077",
        ):
            assert directive in lines, (install, directive)
        (families,) = [line for line in lines if line.startswith("RestrictAddressFamilies=")]
        assert "AF_UNIX" in families.split("=", 1)[1].split()  # the systemd collector's D-Bus socket
        # ProtectClock= would deny the timex collector's read-only adjtimex(2)
        assert not any(line.startswith("ProtectClock=") for line in lines)


def test_package_drop_in_replaces_debians_command_and_user() -> None:
    lines = _service_lines(role.render(https_host_config(node_exporter_install="package"), "10.0.0.5"))
    starts = [line for line in lines if line.startswith("ExecStart=")]
    assert starts[0] == "ExecStart="  # clears Debian's ExecStart before setting ours
    assert starts[1].startswith("ExecStart=/usr/bin/prometheus-node-exporter --web.listen-address=10.0.0.5:9100")
    assert "EnvironmentFile=" in lines  # Debian's /etc/default ARGS no longer apply
    assert "User=node_exporter" in lines
    assert not any(line.startswith("WantedBy=") for line in lines)  # Debian's unit keeps its own [Install]


# --- the controller's checked download ------------------------------------------------------------------------------

def _release_tarball(directory: Path, version: str = "1.9.1", binary: bytes = b"\x7fELF node_exporter") -> Path:
    stem = f"node_exporter-{version}.linux-amd64"
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for name, content in ((f"{stem}/node_exporter", binary), (f"{stem}/LICENSE", b"Apache-2.0\n")):
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.mode = 0o755
            tar.addfile(info, io.BytesIO(content))
    path = directory / f"{stem}.tar.gz"
    path.write_bytes(raw.getvalue())
    return path


def test_a_tarball_with_its_digest_is_fetched_once_and_kept(tmp_path: Path) -> None:
    source = _release_tarball(tmp_path)
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    kept = fetch_verified(source.as_uri(), digest, cache=tmp_path / "cache")
    assert kept == tmp_path / "cache" / digest / source.name
    assert kept.read_bytes() == source.read_bytes()
    source.unlink()  # a second deploy checks the kept copy and does not fetch again
    assert fetch_verified(source.as_uri(), digest.upper(), cache=tmp_path / "cache") == kept
    assert role.binary_sha256(kept) == hashlib.sha256(b"\x7fELF node_exporter").hexdigest()


def test_a_wrong_digest_is_a_clear_error_and_nothing_is_kept(tmp_path: Path) -> None:
    source = _release_tarball(tmp_path)
    found = hashlib.sha256(source.read_bytes()).hexdigest()
    url = source.as_uri()
    with pytest.raises(DownloadError) as raised:
        fetch_verified(url, UPSTREAM_1_9_1_AMD64, cache=tmp_path / "cache")
    message = str(raised.value)
    assert url in message and f"expected sha256 {UPSTREAM_1_9_1_AMD64}" in message and f"found {found}" in message
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []


def test_a_kept_file_that_changed_is_fetched_again(tmp_path: Path) -> None:
    source = _release_tarball(tmp_path)
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    kept = fetch_verified(source.as_uri(), digest, cache=tmp_path / "cache")
    kept.write_bytes(b"damaged")
    from gpufleet import downloads as download

    download._checked.clear()  # a new deploy (process) checks the kept copy again
    assert fetch_verified(source.as_uri(), digest, cache=tmp_path / "cache").read_bytes() == source.read_bytes()


def test_an_unreachable_url_and_a_malformed_digest_are_named(tmp_path: Path) -> None:
    missing = (tmp_path / "nowhere.tar.gz").as_uri()
    with pytest.raises(DownloadError, match=f"cannot fetch {missing}"):
        fetch_verified(missing, UPSTREAM_1_9_1_AMD64, cache=tmp_path / "cache")
    with pytest.raises(DownloadError, match="expected a SHA-256 of 64 hex digits"):
        fetch_verified(missing, "1234", cache=tmp_path / "cache")


def test_a_tarball_without_the_binary_is_refused(tmp_path: Path) -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        info = tarfile.TarInfo("node_exporter-1.9.1.linux-amd64/README")
        tar.addfile(info, io.BytesIO(b""))
    path = tmp_path / "empty.tar.gz"
    path.write_bytes(raw.getvalue())
    with pytest.raises(DownloadError, match="expected node_exporter-<version>"):
        role.binary_sha256(path)


# --- Debian's packages, as the lab reads them ---------------------------------------------------------------------

def test_debian_versions_and_dependencies_are_read_like_dpkg(tmp_path: Path) -> None:
    assert debian_extras.upstream_version("1.5.0-1+b6") == "1.5.0"
    assert debian_extras.upstream_version("2:1.7.0-3") == "1.7.0"
    fields = {"Pre-Depends": "init-system-helpers (>= 1.54~)", "Depends": "adduser, libc6 (>= 2.34) | libc6.1"}
    assert debian_extras.dependency_groups(fields) == [
        [("init-system-helpers", ">= 1.54~")], [("adduser", "")], [("libc6", ">= 2.34"), ("libc6.1", "")],
    ]
    status = tmp_path / "var/lib/dpkg/status"
    status.parent.mkdir(parents=True)
    status.write_text(
        "Package: adduser\nStatus: install ok installed\nVersion: 3.134\n\n"
        "Package: libc6\nStatus: install ok installed\nVersion: 2.36-9\nProvides: libc6-virtual\n\n"
        "Package: old\nStatus: deinstall ok config-files\nVersion: 1\n"
    )
    installed = debian_extras.installed_packages(tmp_path)
    assert installed == {"adduser": "3.134", "libc6": "2.36-9", "libc6-virtual": ""}
    assert debian_extras.installed_packages(tmp_path / "nothing") is None


def test_only_what_the_base_lacks_is_downloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    index = {
        "prometheus-node-exporter": {"Package": "prometheus-node-exporter", "Filename": "p.deb",
                                     "Depends": "adduser, libc6 (>= 2.34), newlib | altlib"},
        "newlib": {"Package": "newlib", "Filename": "n.deb", "Depends": "libc6"},
        "altlib": {"Package": "altlib", "Filename": "a.deb"},
    }

    def records(names, found):  # apt-cache's answers, from the index above
        for name in names:
            if name in index:
                found.setdefault(name, index[name])
        return found

    monkeypatch.setattr(debian_extras, "_apt_records", records)
    base = {"adduser": "3.134", "libc6": "2.36-9"}
    assert debian_extras.missing_dependencies("prometheus-node-exporter", base) == [
        "prometheus-node-exporter", "newlib"
    ]
    assert debian_extras.missing_dependencies("prometheus-node-exporter", {**base, "altlib": "1"}) == [
        "prometheus-node-exporter"
    ]


# --- systemd-analyze security's exposure score ---------------------------------------------------------------------

ANALYZE_UTF8 = (  # each table row split at the DESCRIPTION column
    "  NAME                                                        "
    "DESCRIPTION                                                EXPOSURE\n"
    "✗ PrivateNetwork=                                             "
    "Service has access to the host's network                        0.5\n"
    "✓ UMask=                                                      "
    "Files created by service are accessible only by service's own user by default\n"
    "\n"
    "→ Overall exposure level for node_exporter.service: 1.7 OK 🙂\n"
)
ANALYZE_ASCII = "-> Overall exposure level for vllm@0.service: 9.6 UNSAFE :-{\n"


def test_exposure_score_reads_the_overall_line() -> None:
    assert exposure_score(ANALYZE_UTF8) == 1.7
    rated = exposure(ANALYZE_ASCII)
    assert (rated.unit, rated.score, rated.level) == ("vllm@0.service", 9.6, "UNSAFE")
    assert exposure_score("→ Overall exposure level for x.service: 10.0 DANGEROUS 😵\n") == 10.0


def test_exposure_score_refuses_output_without_the_line() -> None:
    with pytest.raises(ExposureParseError, match="expected 'Overall exposure level"):
        exposure_score("Unit nothing.service not found.\n")
    with pytest.raises(ExposureParseError):
        exposure_score("")


def test_node_report_rates_present_units_and_names_absent_ones() -> None:
    answers = {
        "systemctl list-units --all --plain --no-legend --no-pager 'vllm@*.service'":
            (0, "vllm@0.service loaded active running vLLM replica 0\nvllm@1.service not-found inactive dead vllm@1\n"),
        "systemctl list-units --all --plain --no-legend --no-pager node_exporter.service":
            (0, "node_exporter.service loaded active running Prometheus node_exporter\n"),
        "systemctl list-units --all --plain --no-legend --no-pager dcgm-exporter.service": (0, ""),
        "systemctl show --property=LoadState --value dcgm-exporter.service": (0, "not-found\n"),
        "systemd-analyze security --no-pager vllm@0.service": (0, ANALYZE_ASCII),
        "systemd-analyze security --no-pager node_exporter.service": (0, ANALYZE_UTF8),
    }
    asked: list[str] = []

    def run(command: str) -> tuple[int, str]:
        asked.append(command)
        return answers.get(command, (1, ""))

    report = node_report(run, ("vllm@*.service", "node_exporter.service", "dcgm-exporter.service"))
    assert report == {
        "vllm@0.service": {"present": True, "exposure": 9.6, "level": "UNSAFE"},
        "node_exporter.service": {"present": True, "exposure": 1.7, "level": "OK"},
        "dcgm-exporter.service": {"present": False},
    }
    assert not any("vllm@1" in command for command in asked if command.startswith("systemd-analyze"))


def test_apt_cache_keeps_its_package_cache_in_the_labs_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUFLEET_LAB_CACHE", str(tmp_path / "cache"))
    assert debian_extras._apt_cache_kept() == [
        "-o", f"Dir::Cache::pkgcache={tmp_path / 'cache' / 'apt-pkgcache' / 'pkgcache.bin'}",
        "-o", f"Dir::Cache::srcpkgcache={tmp_path / 'cache' / 'apt-pkgcache' / 'srcpkgcache.bin'}"]
    assert (tmp_path / "cache" / "apt-pkgcache").is_dir()
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("GPUFLEET_LAB_CACHE", str(tmp_path / "file"))  # no directory can be made there: apt's own
    assert debian_extras._apt_cache_kept() == []


def test_debs_already_kept_are_used_when_apt_knows_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    kept = [tmp_path / name for name in ("haproxy_2.6.12-1+deb12u4_amd64.deb", "keepalived_1%3a2.2.7-1+b2_amd64.deb",
                                         "prometheus-alertmanager_0.25.0-1+b4_amd64.deb",
                                         "prometheus-node-exporter_1.5.0-1+b6_amd64.deb",
                                         "prometheus_2.42.0+ds-5+deb12u1_amd64.deb")]
    for deb in kept:
        deb.write_bytes(b"deb")
    assert {deb.name.split("_")[0] for deb in kept} == set(debian_extras.DEBIAN_PACKAGES)
    monkeypatch.setattr(debian_extras, "_apt_records", lambda names, found: found)  # no package lists

    def no_apt(argv, cwd=None):
        raise AssertionError(f"ran {argv}")

    monkeypatch.setattr(debian_extras, "_run", no_apt)
    assert debian_extras.fetch_debs(tmp_path, None) == kept


def test_debs_missing_come_in_one_apt_download_each_checked_and_kept_ones_stay(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    payload = {"a": b"deb a", "b": b"deb b", "c": b"deb c"}
    records = [{"Package": n, "Version": "1", "Filename": f"pool/{n}_1_all.deb",
                "SHA256": hashlib.sha256(payload[n]).hexdigest()} for n in payload]
    (tmp_path / "a_1_all.deb").write_bytes(payload["a"])  # kept: its sha256 is the index's
    calls: list[list[str]] = []

    def apt(argv: list[str], cwd: Path | None = None) -> str:
        calls.append(argv)
        assert cwd is not None
        for word in argv[argv.index("download") + 1:]:
            name = word.split("=")[0]
            (cwd / f"{name}_1_all.deb").write_bytes(payload[name])
        return ""

    monkeypatch.setattr(debian_extras, "_run", apt)
    monkeypatch.setattr(debian_extras, "_deb_field", lambda deb, field: deb.name.split("_")[0])
    assert debian_extras._download(records, tmp_path) == [tmp_path / f"{n}_1_all.deb" for n in payload]
    assert [argv[-2:] for argv in calls] == [["b=1", "c=1"]]  # one apt start for both
    assert (tmp_path / "c_1_all.deb").read_bytes() == payload["c"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_1_all.deb", "b_1_all.deb", "c_1_all.deb"]

    payload["b"] = b"tampered"
    (tmp_path / "b_1_all.deb").unlink()
    with pytest.raises(LabError, match=r"b_1_all.deb: expected sha256 .* found "):
        debian_extras._download(records, tmp_path)
    assert not (tmp_path / "b_1_all.deb").exists()
