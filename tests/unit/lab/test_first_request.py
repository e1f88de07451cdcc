"""``gpufleet lab client`` without a lab (lab/gpufleet_lab/first_request.py): the routers' endpoint, the CA, a
client's key file and a curl line, from an inventory with routers; the key only in a 0600 header file."""

from __future__ import annotations

import os
import shlex
import stat
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from gpufleet_lab import first_request as module
from gpufleet_lab.cli import lab_group
from gpufleet_lab.errors import LabError, LabInputError

from gpufleet.config.settings.router import RouterClient
from gpufleet.inventory.load import load_fleet
from gpufleet.values.types import SecretRef
from tests.conftest import DATA

FLEET = str(DATA / "rollout_fleet" / "inventory.py")
KEY = "sk-lab-client-0123456789abcdef"


@pytest.fixture
def fleet_with_clients(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The rollout fleet with TLS on its routers and two clients: ``lab`` (its key in a file), ``env`` (in an
    environment variable); the key file's folder."""
    fleet = load_fleet(FLEET)
    ca, key = tmp_path / "ca.crt", tmp_path / "router-client-key"
    ca.write_text("-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n")
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    monkeypatch.setenv("LAB_CLIENT_KEY", KEY)
    update = {"router_tls_certificate": SecretRef(file=str(ca)), "router_tls_key": SecretRef(file=str(ca)),
              "router_tls_ca": str(ca), "router_clients": {
                  "lab": RouterClient(api_key=SecretRef(file=str(key))),
                  "env": RouterClient(api_key=SecretRef(env="LAB_CLIENT_KEY"))}}
    for host, cfg in list(fleet.configs.items()):
        fleet.configs[host] = cfg.model_copy(update=update)
    monkeypatch.setattr(module, "load_fleet", lambda inventory: fleet)
    return tmp_path


def test_the_way_in_is_printed_and_the_key_is_only_in_a_private_header_file(fleet_with_clients: Path) -> None:
    found = module.first_request(FLEET, "lab")
    lines = found.lines()
    assert lines[0].startswith("endpoint: https://") and lines[0].endswith('/v1 (model "llama-3.1-70b")'), lines
    assert lines[1] == f"CA: {fleet_with_clients / 'ca.crt'}"
    headers = fleet_with_clients / "client-lab.headers"
    assert lines[2] == f"client key: {fleet_with_clients / 'router-client-key'} (client lab; curl reads it from" \
                       f" {headers}, 0600)"
    assert headers.read_text() == f"Authorization: Bearer {KEY}\n"
    assert stat.S_IMODE(headers.stat().st_mode) == 0o600
    assert KEY not in "\n".join(lines)
    words = shlex.split(lines[3])
    assert words == found.curl() and words[words.index("-H") + 1] == f"@{headers}"
    assert words[-1] == found.url + "/v1/completions" and words[words.index("--cacert") + 1].endswith("ca.crt")


@pytest.mark.parametrize(("client", "expected"), [
    ("nobody", "--client: expected a router client of {fleet} (env, lab), found 'nobody'"),
    ("env", "router_clients.env.api_key: expected a file (curl reads the key from a file beside it), found an"
            " environment variable"),
])
def test_a_client_it_cannot_serve_is_one_line(fleet_with_clients: Path, client: str, expected: str) -> None:
    with pytest.raises(LabError) as error:
        module.first_request(FLEET, client)
    assert str(error.value) == expected.format(fleet=FLEET)
    assert not (fleet_with_clients / f"client-{client}.headers").exists()


@pytest.mark.parametrize("client", ["", "lab\nFAKE: ok", "lab;$(touch x)`id`|&>x", "../../etc/passwd", "\x1b[2Jx",
                                    "x" * 64])
def test_a_name_no_client_can_have_is_refused_before_the_inventory_is_read(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           client: str) -> None:
    monkeypatch.setattr(module, "load_fleet", lambda inventory: pytest.fail("the inventory was read"))
    with pytest.raises(LabInputError) as error:
        module.first_request(FLEET, client)
    assert str(error.value).startswith("--client: expected a client name (1-63 of letters, digits, '_', '.', '-',")


@pytest.mark.parametrize(("make", "found"), [
    (lambda path: None, "no such file"),
    (lambda path: path.mkdir(), "a directory"),
    (lambda path: os.mkfifo(path), "a named pipe"),
    (lambda path: path.symlink_to(path), "a link loop"),
])
def test_lab_client_on_an_inventory_that_is_no_file_exits_2_in_one_line(tmp_path: Path, make: Any,
                                                                         found: str) -> None:
    """The real command: bad input is one line and exit 2, as gpufleet's own commands (a lab failure is 1)."""
    inventory = tmp_path / "inventory.py"
    make(inventory)
    done = CliRunner().invoke(lab_group, ["client", "--inventory", str(inventory)])
    assert done.exit_code == 2, done.output
    assert done.output == f"gpufleet lab: {inventory}: expected an inventory file, found {found}\n"


def test_lab_client_writes_a_control_character_in_its_input_as_an_escape(tmp_path: Path) -> None:
    inventory = tmp_path / "in\nventory\x1b.py"
    done = CliRunner().invoke(lab_group, ["client", "--inventory", str(inventory)])
    assert done.exit_code == 2 and done.output.count("\n") == 1, done.output
    assert "in\\nventory\\x1b.py" in done.output and "\x1b" not in done.output
