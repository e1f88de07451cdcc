"""``gpufleet diag``'s one archive (gpufleet/diag/archive.py, gpufleet/diag/redact.py): every secret the fleet holds
planted in what the nodes collect, in each form it may take, and not one byte of any found in the archive (its
compressed bytes, its tar stream, every member, every member decompressed); its index of what could not be read and
why; the findings of the failure-signature scan."""

from __future__ import annotations

import gzip
import io
import json
import secrets
import tarfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from gpufleet.config.schema import SECRET_KEYS, SECRET_TREES
from gpufleet.config.settings.router import RouterClient
from gpufleet.diag.archive import write_archive
from gpufleet.diag.collect import NodeRun, collect
from gpufleet.diag.options import OutReplaced, out_path
from gpufleet.diag.redact import fleet_secrets
from gpufleet.node.replica_rank import SECRET_ENV
from gpufleet.values.types import SecretRef
from tests.unit.diag_nodes import FakeNode, LocalNodes

HOST = "gpu-a01"
REPLICA = "llama_70b-0"


def _pem_key() -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


@pytest.fixture
def fleet_secrets_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """A value for every secret kind, made for this run, set where the configuration's references point."""
    values = {
        "vllm_api_key": "vk-" + secrets.token_hex(12), "vllm_hf_token": "hf_" + secrets.token_hex(16),
        "vllm_pip_index_credentials": f"builder:p@ss/{secrets.token_hex(6)}", "ray_auth_token": secrets.token_hex(20),
        "router_vrrp_password": secrets.token_hex(4), "router_tls_key": _pem_key(),
        "router_clients": "ck-" + secrets.token_urlsafe(24),
    }
    for key, value in values.items():
        if key == "router_tls_key":
            (tmp_path / "tls.key").write_text(value)
        else:
            monkeypatch.setenv(f"T_{key.upper()}", value)
    return values


def _config() -> SimpleNamespace:
    """A host's configuration with a reference for every secret variable (the routers' clients: a tree of them)."""
    refs: dict[str, Any] = {key: SecretRef(env=f"T_{key.upper()}") for key in SECRET_KEYS}
    refs["router_tls_certificate"] = None
    refs["router_clients"] = {"app": RouterClient(api_key=SecretRef(env="T_ROUTER_CLIENTS"))}
    return SimpleNamespace(**refs)


def _forms(values: dict[str, str], rank_secret: str) -> dict[str, bytes]:
    """What must never be found: each value, each line of the key's body, the index password alone."""
    found = {key: value.encode() for key, value in values.items()}
    found |= {f"router_tls_key line {n}": line.encode()
              for n, line in enumerate(values["router_tls_key"].splitlines()) if not line.startswith("-----")}
    found["pip password"] = values["vllm_pip_index_credentials"].split(":", 1)[1].encode()
    found["rank secret"] = rank_secret.encode()
    return found


def _plant(node: FakeNode, values: dict[str, str], rank_secret: str) -> None:
    """Each secret in the node's journals and files, as it may appear: as is, in JSON, in a URL, by its name."""
    user, password = values["vllm_pip_index_credentials"].split(":", 1)
    lines = [f"using key {values['vllm_api_key']} and token {values['vllm_hf_token']}", f"{SECRET_ENV}={rank_secret}",
             f"index https://{quote(user)}:{quote(password, safe='')}@pypi.example.net/simple",
             f"pip password alone: {password}", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"]
    stamp = f"2026-11-20T10:00:00+0000 {HOST}"
    node.journal(f"vllm@{REPLICA}.service", "".join(f"{stamp} vllm[9]: {text}\n" for text in lines))
    key_body = values["router_tls_key"].splitlines()[1:-1]  # its lines, without the markers
    node.journal("haproxy.service", "".join(f"{stamp} haproxy[1]: {text}\n"
                                            for text in [f"client key {values['router_clients']}", *key_body]))
    node.journal("keepalived.service", f"{stamp} Keepalived: pass {values['router_vrrp_password']}\n")
    node.journal(f"gpufleet-ray-{REPLICA}.service", f"{stamp} ray: {values['ray_auth_token']}\n")
    node.file(f"/etc/gpufleet/vllm/{REPLICA}/observed.json",
              json.dumps({"note": values["router_tls_key"], "key": values["vllm_api_key"]}) + "\n")


def _every_byte(archive: bytes) -> Iterator[tuple[str, bytes]]:
    """The archive as written, its tar stream, every member, and every member decompressed where compressed."""
    yield "the archive", archive
    yield "its tar stream", gzip.decompress(archive)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar:
            data = tar.extractfile(member).read() if member.isfile() else b""  # type: ignore[union-attr]
            yield member.name, data
            if data.startswith(b"\x1f\x8b"):
                yield f"{member.name} decompressed", gzip.decompress(data)


def _members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]


def test_every_secret_kind_is_read_from_its_reference(fleet_secrets_set: dict[str, str], tmp_path: Path) -> None:
    cfg = _config()
    cfg.router_tls_key = SecretRef(file=str(tmp_path / "tls.key"))
    found = fleet_secrets([cfg, cfg])
    assert found.unread == []
    assert set(found.forms) == (SECRET_KEYS | SECRET_TREES) - {"router_tls_certificate"}
    for key, value in fleet_secrets_set.items():
        assert value.strip().encode() in found.forms[key], key


def test_a_secret_that_cannot_be_read_is_named_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    found = fleet_secrets([SimpleNamespace(vllm_api_key=SecretRef(env="T_UNSET_FOR_THIS_TEST"))])
    assert found.forms == {} and len(found.unread) == 1
    assert "vllm_api_key" in found.unread[0] and "T_UNSET_FOR_THIS_TEST" in found.unread[0]


def test_no_secret_reaches_the_archive(fleet_secrets_set: dict[str, str], tmp_path: Path) -> None:
    node = FakeNode(tmp_path / HOST, [f"vllm@{REPLICA}.service", "haproxy.service", "keepalived.service",
                                      f"gpufleet-ray-{REPLICA}.service"])
    rank_secret = secrets.token_hex(16)
    _plant(node, fleet_secrets_set, rank_secret)
    cfg = _config()
    cfg.router_tls_key = SecretRef(file=str(tmp_path / "tls.key"))
    runs = collect([HOST], lambda host: LocalNodes({HOST: node}), 3600, 1 << 20)
    assert runs[HOST].problem is None, runs[HOST].problem
    # a node's archive with a compressed member too (a rotated log): its text is searched as well
    rotated = gzip.compress("\n".join(fleet_secrets_set.values()).encode())
    runs[HOST] = NodeRun(HOST, 1.0, _with_member(runs[HOST].archive, "journal/old.log.gz", rotated))
    out = out_path(str(tmp_path / "diag.tar.gz"))
    written = write_archive(out, runs, fleet_secrets([cfg]), {"inventory": "x"}, 1 << 20)
    archive = written.path.read_bytes()
    for where, data in _every_byte(archive):
        for kind, form in _forms(fleet_secrets_set, rank_secret).items():
            assert form not in data, f"{kind} found in {where}"
    members = _members(written.path)
    assert members[f"nodes/{HOST}/journal/old.log"].count(b"[redacted]") >= len(fleet_secrets_set)
    assert b"CUDA out of memory" in members[f"nodes/{HOST}/journal/vllm@{REPLICA}.service.log"]  # the rest is kept
    assert written.index["redacted"]["vllm_api_key"] >= 1 and written.index["redacted"]["by name"] >= 1
    assert written.path.stat().st_mode & 0o777 == 0o600


def _with_member(archive: bytes, name: str, data: bytes) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar, tarfile.open(fileobj=out, mode="w:gz") as copy:
        for member in tar:
            copy.addfile(member, tar.extractfile(member))
        info = tarfile.TarInfo(name)
        info.size = len(data)
        copy.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _node_archive(members: dict[str, bytes | None]) -> bytes:
    """A node's archive as given: a None member is a link to /etc/shadow."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/shadow"
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_the_index_says_what_could_not_be_read_and_why(tmp_path: Path) -> None:
    node_index = {"unread": [{"what": "the journal of vllm@x.service", "why": "journalctl did not end within 20 s"}],
                  "since": "2026-11-20T09:00:00Z", "seconds": 3.2, "bytes": 40}
    archive = _node_archive({"index.json": json.dumps(node_index).encode(), "units.json": b"{}\n",
                             "shadow": None, "../escape.log": b"x", "bad.log.gz": b"\x1f\x8bnot gzip at all",
                             "kernel.log": b"2026-11-21T03:12:09+00:00 NVRM: Xid (PCI:0000:3b:00): 79, pid=1,"
                                           b" GPU has fallen off the bus.\n"})
    runs = {HOST: NodeRun(HOST, 3.5, archive), "gpu-a02": NodeRun("gpu-a02", 60, problem="no answer within 60 s")}
    written = write_archive(out_path(str(tmp_path / "d.tar.gz")), runs, fleet_secrets([]), {"since": "1h"}, 1 << 20,
                            plan={"replicas": []})
    nodes = written.index["nodes"]
    whys = {u["what"]: u["why"] for u in nodes[HOST]["unread"]}
    assert whys["the journal of vllm@x.service"] == "journalctl did not end within 20 s"
    assert whys["member 'shadow'"] == whys["member '../escape.log'"] == "not a plain file name"
    assert whys["bad.log.gz"].startswith("compressed and unreadable")
    assert nodes["gpu-a02"] == {"seconds": 60, "archive_bytes": 0, "members": [], "unread": [],
                                "problem": "no answer within 60 s", "node": dict.fromkeys(
                                    ("since", "budget_s", "seconds", "bytes", "redacted"))}
    members = _members(written.path)
    assert set(members) == {"index.json", "findings.txt", "plan.json", f"nodes/{HOST}/index.json",
                            f"nodes/{HOST}/units.json", f"nodes/{HOST}/kernel.log"}
    assert [f.signature for f in written.findings] == ["xid_79"]
    assert members["findings.txt"].decode().startswith(f"{HOST}: Xid 79 on the GPU at PCI 0000:3b:00")
    assert json.loads(members["index.json"])["findings"][0]["first_seen"] == "2026-11-21T03:12:09+00:00"


def test_a_node_archive_over_its_cap_is_cut_and_said(tmp_path: Path) -> None:
    archive = _node_archive({"a.log": b"a" * 600, "b.log": b"b" * 600})
    out = out_path(str(tmp_path / "d.tar.gz"))
    written = write_archive(out, {HOST: NodeRun(HOST, 1, archive)}, fleet_secrets([]), {}, 1000)
    assert set(_members(written.path)) == {"index.json", "findings.txt", f"nodes/{HOST}/a.log"}
    assert written.index["nodes"][HOST]["unread"] == [{"what": "b.log", "why": "over the node's cap of 1,000 bytes"}]


@pytest.mark.parametrize("swap", ["another file", "a link"])
def test_an_out_file_replaced_during_the_run_is_neither_written_nor_removed(tmp_path: Path, swap: str) -> None:
    """The archive goes into the file --out made, and only that one: a file or link put in its place while the
    nodes were read is left as it is, and the run says so."""
    out = out_path(str(tmp_path / "d.tar.gz"))
    out.path.unlink()
    if swap == "a link":
        out.path.symlink_to(tmp_path / "target")
    else:
        out.path.write_text("someone else's\n")
    with pytest.raises(OutReplaced):
        write_archive(out, {HOST: NodeRun(HOST, 1, problem="no answer")}, fleet_secrets([]), {}, 1000)
    assert out.path.is_symlink() if swap == "a link" else out.path.read_text() == "someone else's\n"
    assert not (tmp_path / "target").exists()
