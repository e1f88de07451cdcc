"""The CA gpufleet's clients of the routers trust (router_tls_ca), checked before any host with real certificates
(openssl, as the lab makes its own): the CA that signs router_tls_certificate passes; another CA, which every client
would refuse, is one line; routers that disagree on it are one line."""

from __future__ import annotations

import shutil
from pathlib import Path

from click.testing import CliRunner
from gpufleet_lab.tls import LabTls, make_lab_tls

from gpufleet.cli.main import main
from gpufleet.values.grammar import show
from tests.conftest import DATA

ROUTERS = {"router1.dc1.example.net": "10.40.9.1", "router2.dc1.example.net": "10.40.9.2"}


def _fleet(folder: Path, tls: LabTls, cas: dict[str, str | None]) -> str:
    """The rollout fleet's copy whose routers serve ``tls``'s certificate, each router's router_tls_ca as given."""
    shutil.copytree(DATA / "rollout_fleet" / "group_vars", folder / "group_vars")
    with (folder / "group_vars" / "all.yml").open("a") as out:
        out.write(f"router_tls_certificate: {{file: {tls.certificate}}}\nrouter_tls_key: {{file: {tls.key}}}\n")
    routers = ",\n".join(
        f"    ({name!r}, {{'fleet_address': {address!r}" + (f", 'router_tls_ca': {cas[name]!r}" if cas[name] else "")
        + "})" for name, address in ROUTERS.items())
    source = (DATA / "rollout_fleet" / "inventory.py").read_text()
    start = source.index("routers = [")
    end = source.index("]\n", start) + 2
    (folder / "inventory.py").write_text(source[:start] + f"routers = [\n{routers},\n]\n" + source[end:])
    return str(folder / "inventory.py")


def _check(inventory: str) -> tuple[int, list[str]]:
    done = CliRunner().invoke(main, ["check", inventory], prog_name="gpufleet")
    return done.exit_code, done.output.strip().splitlines()


def test_the_ca_that_signs_the_routers_certificate_passes_and_another_is_refused(tmp_path: Path) -> None:
    ours = make_lab_tls(tmp_path / "ours", list(ROUTERS.values()))
    other = make_lab_tls(tmp_path / "other", list(ROUTERS.values()))
    right = str(ours.ca_certificate)
    assert _check(_fleet(tmp_path / "right", ours, dict.fromkeys(ROUTERS, right))) == (
        0, [f"{tmp_path / 'right' / 'inventory.py'}: 5 hosts in 1 pools: configuration valid"])
    code, lines = _check(_fleet(tmp_path / "wrong", ours, dict.fromkeys(ROUTERS, str(other.ca_certificate))))
    assert code == 2, lines  # one line for both routers
    assert lines == [f"{tmp_path / 'wrong' / 'inventory.py'}: router_tls_ca: expected the CA router_tls_certificate"
                     " chains to, found one a client refuses it with (CERTIFICATE_VERIFY_FAILED) (hosts"
                     " router1.dc1.example.net, router2.dc1.example.net)"], lines
    assert not any("PRIVATE" in line or "BEGIN" in line for line in lines)


def test_routers_that_disagree_on_the_ca_are_refused(tmp_path: Path) -> None:
    ours = make_lab_tls(tmp_path / "ours", list(ROUTERS.values()))
    right = str(ours.ca_certificate)
    code, lines = _check(_fleet(tmp_path / "one", ours, {"router1.dc1.example.net": right,
                                                         "router2.dc1.example.net": None}))
    assert code == 2, lines
    assert lines == [f"{tmp_path / 'one' / 'inventory.py'}: router_tls_ca: expected one value on every router (clients"
                     f" reach any of them), found router1.dc1.example.net: {show(right)},"
                     " router2.dc1.example.net: none (hosts router1.dc1.example.net, router2.dc1.example.net)"], lines
