"""The node tool of ``gpufleet diag`` (gpufleet/node/diag_collect.py), run as a node runs it, on a fake node
(tests/unit/diag_nodes.py: a folder for its root, stand-in systemctl and journalctl): what it collects, what it never
reads, what it redacts by name (cases as data: tests/data/diag/redact_names.yml), its byte and time bounds, and its
index of what could not be read."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gpufleet import node_paths
from gpufleet.config.schema import RECORDS
from gpufleet.config.settings.node_lifecycle import KMSG
from gpufleet.diag.captures import capture_name
from gpufleet.node import diag_collect
from gpufleet.node.replica_rank import SECRET_ENV
from tests.conftest import DATA
from tests.unit.diag_nodes import FakeNode

REPLICA = "llama_70b-0"
UNITS = (f"vllm@{REPLICA}.service", "haproxy.service", "gpufleet-gpu-watch.service")
API_KEY = "k-Qx7-never-collected-4471"


def _collect(node: FakeNode, tmp_path: Path, *args: str) -> tuple[dict[str, Any], dict[str, bytes], Path]:
    """Run ``collect``; its index, its members by name, and its archive."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    done = node.run(["collect", "--since-s", "3600", "--max-bytes", "100000", "--budget-s", "30",
                     "--out-dir", str(out), *args])
    assert done.returncode == 0, done.stderr
    archive = Path(json.loads(done.stdout)["archive"])
    with tarfile.open(archive) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
    return json.loads(members["index.json"]), members, archive


@pytest.fixture
def node(tmp_path: Path) -> FakeNode:
    found = FakeNode(tmp_path / "node", UNITS)
    directory = node_paths.replica_dir(REPLICA)
    found.file(f"{directory}/config.yaml", "port: 8000\nmax-model-len: 32768\n")
    found.file(f"{directory}/release.json", '{"vllm_version": "0.32.0"}\n')
    found.file(node_paths.replica_secrets(REPLICA), f'VLLM_API_KEY="{API_KEY}"\n')
    (found.root / directory.lstrip("/") / "vllm.env").symlink_to(found.root / node_paths.replica_secrets(REPLICA)[1:])
    (found.root / directory.lstrip("/") / "venv").symlink_to("/opt/vllm/0.32.0")
    found.file(f"{node_paths.BURN_IN_DIR}/full.json", '{"tier": "full", "passed": false}\n')
    found.file(node_paths.NODE_STATE_FILE, '{"state": "quarantined"}\n')
    found.journal(f"vllm@{REPLICA}.service", "2026-11-20T10:00:01+0000 gpu-a01 vllm[9]: started\n"
                                             f"2026-11-20T10:00:02+0000 gpu-a01 vllm[9]: {SECRET_ENV}=r4nk-s3cret\n")
    found.journal("haproxy.service", "2026-11-20T10:00:03+0000 gpu-a01 haproxy[1]: Proxy started.\n")
    found.file("/journals-are-elsewhere", "")
    (found.journals / "kernel.log").write_text(
        "2026-11-20T10:00:04+0000 gpu-a01 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\n"
        "2026-11-20T10:00:05+0000 gpu-a01 kernel: e1000e: eth0 NIC Link is Up\n")
    return found


def test_a_node_gives_its_units_journals_files_and_kernel_lines(node: FakeNode, tmp_path: Path) -> None:
    index, members, archive = _collect(node, tmp_path)
    assert {f"journal/{unit}.log" for unit in UNITS[:2]} <= set(members)
    assert members[f"replicas/{REPLICA}/config.yaml"].startswith(b"port: 8000")
    assert members[f"replicas/{REPLICA}/release.json"] == b'{"vllm_version": "0.32.0"}\n'
    assert json.loads(members["units.json"])[UNITS[0]]["NRestarts"] == "2"
    assert members["kernel.log"].count(b"\n") == 1 and b"Xid" in members["kernel.log"]  # the NIC's line left out
    assert members["burn-in/full.json"] and members["node/state.json"]
    assert index["venvs"] == {REPLICA: "/opt/vllm/0.32.0"}
    assert {m["name"] for m in index["members"]} == set(members) - {"index.json"}
    assert archive.stat().st_mode & 0o777 == 0o600 and archive.parent.stat().st_mode & 0o777 == 0o700


def test_the_kernel_log_is_the_file_the_node_watch_reads_when_it_is_one(node: FakeNode, tmp_path: Path) -> None:
    """A node whose watch reads a file in place of /dev/kmsg (node_kernel_log): its Xid lines come from that file."""
    log = "/var/log/kernel-double/kmsg"
    node.file(node_paths.LIFECYCLE_CONFIG, json.dumps({"kernel_log": log}))
    node.file(log, "NVRM: Xid (PCI:0000:1b:00): 48, pid=4242, name=python3, DBE\nother line\n")
    index, members, _ = _collect(node, tmp_path)
    assert members["kernel.log"] == b"NVRM: Xid (PCI:0000:1b:00): 48, pid=4242, name=python3, DBE\n"
    assert [m["source"] for m in index["members"] if m["name"] == "kernel.log"] == [f"{log} (NVRM and Xid lines)"]


def test_boots_of_the_window_say_how_the_boot_before_each_ended(node: FakeNode, tmp_path: Path) -> None:
    """A boot that began in the window is listed with how the one before it ended: after systemd's shutdown, or
    without one (its journal just stops); a boot before the window is left out."""
    now = int(time.time() * 1e6)
    ids = [f"{n:x}" * 32 for n in range(10, 14)]
    node.journals.joinpath("boots.json").write_text(json.dumps([
        {"index": -3, "boot_id": ids[0], "first_entry": now - 9000 * 10**6, "last_entry": now - 8000 * 10**6},
        {"index": -2, "boot_id": ids[1], "first_entry": now - 7200 * 10**6, "last_entry": now - 1200 * 10**6},
        {"index": -1, "boot_id": ids[2], "first_entry": now - 1100 * 10**6, "last_entry": now - 600 * 10**6},
        {"index": 0, "boot_id": ids[3], "first_entry": now - 500 * 10**6, "last_entry": now}]))
    node.journals.joinpath(f"boot-{ids[1]}.log").write_text("vllm: serving\nhost0: Link DOWN\n")
    node.journals.joinpath(f"boot-{ids[2]}.log").write_text("Reached target shutdown.target - System Shutdown.\n")
    _, members, _ = _collect(node, tmp_path)
    lines = members["boots.log"].decode().splitlines()
    assert [line.split(" boot ")[1][:12] for line in lines] == [ids[2][:12], ids[3][:12]], lines
    assert lines[0].endswith("without a shutdown (power lost, a hard reset or a kernel that stopped)")
    assert lines[1].endswith("after a shutdown")


def test_the_secrets_are_never_read_and_a_named_one_is_redacted(node: FakeNode, tmp_path: Path) -> None:
    index, members, archive = _collect(node, tmp_path)
    assert API_KEY.encode() not in archive.read_bytes()
    assert not any(API_KEY.encode() in data for data in members.values())
    assert b"r4nk-s3cret" not in members[f"journal/vllm@{REPLICA}.service.log"]
    assert f"{SECRET_ENV}=[redacted]".encode() in members[f"journal/vllm@{REPLICA}.service.log"]
    assert index["redacted"] == 1
    # the replica's vllm.env here is a link into the secrets: never followed, and said so
    assert {"what": f"{node_paths.replica_dir(REPLICA)}/vllm.env", "why": "a link (never followed)"} in index["unread"]


def test_a_file_under_the_secrets_is_refused_by_its_path() -> None:
    collection = diag_collect.Collection("/", 0, 1000, 10)
    collection.read_file(node_paths.replica_secrets(REPLICA), "x")
    assert collection.members == {} and collection.unread[0]["why"] == "never read: it holds secrets"


def test_the_byte_cap_keeps_the_newest_journal_lines(node: FakeNode, tmp_path: Path) -> None:
    lines = [f"2026-11-20T10:{n // 60:02d}:{n % 60:02d}+0000 gpu-a01 vllm[9]: line {n:06d}\n" for n in range(5000)]
    node.journal(f"vllm@{REPLICA}.service", "".join(lines))
    index, members, _ = _collect(node, tmp_path)
    assert sum(len(data) for name, data in members.items() if name != "index.json") <= 100000
    kept = members[f"journal/vllm@{REPLICA}.service.log"]
    assert kept.endswith(lines[-1].encode()) and lines[0].encode() not in kept
    entry = next(m for m in index["members"] if m["name"] == f"journal/vllm@{REPLICA}.service.log")
    assert entry["cut_from"] == len("".join(lines)) and "oldest bytes left out" in entry["cut"]


def test_a_hung_command_is_cut_at_the_budget_and_said(node: FakeNode, tmp_path: Path) -> None:
    node.hang()
    out = tmp_path / "out"
    out.mkdir()
    started = time.monotonic()
    done = node.run(["collect", "--since-s", "60", "--max-bytes", "1000", "--budget-s", "3", "--out-dir", str(out)])
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 15
    with tarfile.open(json.loads(done.stdout)["archive"]) as tar:
        index = json.loads(tar.extractfile("index.json").read())  # type: ignore[union-attr]
    whys = [u["why"] for u in index["unread"]]
    assert any(why.startswith("journalctl did not end within") for why in whys), whys
    assert any(why == "not read: the node's bound of 3 s ran out" for why in whys), whys


def test_remove_deletes_only_a_folder_collect_made(node: FakeNode, tmp_path: Path) -> None:
    done = node.run(["collect", "--since-s", "60", "--max-bytes", "1000", "--budget-s", "10"])  # into /var/tmp
    folder = Path(json.loads(done.stdout)["archive"]).parent
    try:
        assert node.run(["remove", str(folder)]).returncode == 0 and not folder.exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for other in (str(tmp_path), "/var/tmp", "/var/tmp/gpufleet-diag-x/../../etc", "/var/tmp/other"):
        refused = node.run(["remove", other])
        assert refused.returncode != 0 and "not a folder this tool made" in refused.stderr
    assert tmp_path.exists()


REDACT_CASES: list[dict[str, str]] = yaml.safe_load((DATA / "diag" / "redact_names.yml").read_text())


def _private_keys() -> dict[str, str]:
    """The cases' stand-ins for private keys, made now (no key is kept in the repository): a whole EC key in PEM,
    and the first two lines of a PKCS#8 one."""
    key = ec.generate_private_key(ec.SECP256R1())
    pkcs8 = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()).decode()
    traditional = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                    serialization.NoEncryption()).decode()
    return {"EC_KEY": traditional.strip(), "KEY_HEAD": "\n".join(pkcs8.splitlines()[:2])}


@pytest.mark.parametrize("case", REDACT_CASES, ids=[c["id"] for c in REDACT_CASES])
def test_what_is_secret_by_its_place_is_redacted(case: dict[str, str]) -> None:
    text = case["text"]
    for token, key in _private_keys().items():
        text = text.replace(token, key)
    out, count = diag_collect.redact_names(text)
    assert out == case["out"]
    assert (count == 0) == (text == case["out"])


def test_the_node_tool_agrees_with_the_controllers_names() -> None:
    """Its own copies of node_paths' names (a node tool reads only the standard library), and the environment names
    of every secret that reaches a process."""
    tool = diag_collect
    assert (tool.VLLM_ETC, tool.SECRETS_DIR, tool.NODE_STATE_DIR, tool.EVIDENCE_DIR, tool.BURN_IN_DIR,
            tool.ROUTER_SOCKET, tool.ROUTER_HEALTH_STATE, tool.UNIT_PATH) == (
        node_paths.VLLM_ETC, node_paths.SECRETS_DIR, node_paths.NODE_STATE_DIR, node_paths.EVIDENCE_DIR,
        node_paths.BURN_IN_DIR, node_paths.ROUTER_ADMIN_SOCKET, node_paths.ROUTER_HEALTH_STATE,
        node_paths.UNIT_DEFAULT_PATH)
    assert tool.GPU_WATCH_FILES == (node_paths.GPU_WATCH_MARKER, node_paths.GPU_SAMPLES)
    assert (tool.LIFECYCLE_CONFIG, tool.KMSG) == (node_paths.LIFECYCLE_CONFIG, KMSG)
    assert tool.CAPTURES_DIR == node_paths.DIAG_CAPTURES_DIR
    assert tool.CAPTURE_NAME.fullmatch(capture_name(datetime(2026, 11, 28, tzinfo=UTC), "upgrade rolled back a_b-0"))
    assert Path(node_paths.NODE_STATE_FILE).name in tool.NODE_FILES
    assert Path(node_paths.NODE_STATE_SUMMARY).name in tool.NODE_FILES
    units = [node_paths.DCGM_HOSTENGINE, node_paths.DCGM_EXPORTER_SERVICE, node_paths.NODE_EXPORTER_UNIT,
             node_paths.NODE_EXPORTER_PACKAGE_UNIT, node_paths.PROMETHEUS_UNIT, node_paths.ROUTER_SERVICE,
             f"{node_paths.FABRICMANAGER}.service", node_paths.GPU_WATCH_SERVICE, node_paths.NODE_WATCH_SERVICE,
             node_paths.ALERT_LOG_SERVICE, node_paths.ROUTER_HEALTH_SERVICE, node_paths.burn_in_service("full"),
             node_paths.ray_unit(REPLICA), node_paths.watchdog_unit(REPLICA), f"vllm@{REPLICA}.service"]
    for unit in units:
        assert any(Path(unit).match(p) for p in tool.UNIT_PATTERNS), unit
    named = {env for record in RECORDS.values() if record.secret for env in record.owned_env}
    assert named | {SECRET_ENV, "RAY_AUTH_TOKEN", "PIP_INDEX_URL"} <= set(tool.SECRET_ENV_NAMES)
    assert "diag_collect.py" in node_paths.NODE_TOOL_FILES  # role common installs it beside the other tools


def test_an_archive_holds_only_plain_members() -> None:
    collection = diag_collect.Collection("/", 0, 1000, 10)
    collection.add("units.json", b"{}\n", "systemctl show")
    out = Path(diag_collect.write_archive(collection, {"schema": diag_collect.SCHEMA}, "/tmp"))
    try:
        with tarfile.open(fileobj=io.BytesIO(out.read_bytes())) as tar:
            assert [(m.name, m.isfile(), m.mode) for m in tar] == [("index.json", True, 0o600),
                                                                  ("units.json", True, 0o600)]
    finally:
        shutil.rmtree(out.parent)


def test_a_capture_is_kept_on_the_node_newest_first_and_bounded(node: FakeNode) -> None:
    """What a restart loop or a quarantine leaves with no controller there: the last hour's collection in the
    captures' folder (0700), 0600, named by its time and reason; the oldest past --keep removed."""
    folder = node.root / node_paths.DIAG_CAPTURES_DIR.lstrip("/")
    made = []
    for turn in range(3):
        done = node.run(["capture", "--reason", f"restart-loop-vllm-{REPLICA} {turn}", "--keep", "2"])
        assert done.returncode == 0, done.stderr
        made.append(Path(json.loads(done.stdout)["capture"]))
        time.sleep(1.01)  # a name per second
    assert folder.stat().st_mode & 0o777 == 0o700 and sorted(folder.iterdir()) == made[1:]
    assert all(diag_collect.CAPTURE_NAME.fullmatch(p.name) and p.stat().st_mode & 0o777 == 0o600 for p in made[1:])
    assert made[2].name.endswith(f"-restart-loop-vllm-{REPLICA.replace('_', '-')}-2.tar.gz")
    with tarfile.open(made[2]) as tar:
        index = json.loads(tar.extractfile("index.json").read())  # type: ignore[union-attr]
        assert f"journal/vllm@{REPLICA}.service.log" in tar.getnames()
    assert index["capture"] == f"restart-loop-vllm-{REPLICA} 2" and index["since_s"] == diag_collect.CAPTURE_SINCE_S
    listed = node.run(["captures"])
    assert [c["name"] for c in json.loads(listed.stdout)] == [p.name for p in reversed(made[1:])]


@pytest.mark.parametrize("reason", ["", "a\nb", "x" * 201])
def test_a_capture_reason_is_printable_words(node: FakeNode, reason: str) -> None:
    done = node.run(["capture", "--reason", reason])
    assert done.returncode == 2 and "expected 1 to 200 printable characters" in done.stderr


def test_a_router_socket_it_may_not_look_at_is_said_not_fatal(node: FakeNode, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen on a lab router: the capture unit's sandbox may not look into HAProxy's run folder (EACCES on the
    socket's stat); the collection says so and goes on."""
    real = Path.is_socket

    def refused(path: Path) -> bool:
        if str(path).endswith(node_paths.ROUTER_ADMIN_SOCKET):
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(Path, "is_socket", refused)
    c = diag_collect.collect(str(node.root), 3600, 1 << 20, 30, False)
    assert {"what": "HAProxy's servers", "why": f"{node_paths.ROUTER_ADMIN_SOCKET}: Permission denied"} in c.unread
    assert "node/state.json" in c.members  # and the rest was collected
