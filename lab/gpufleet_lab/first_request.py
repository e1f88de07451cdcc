"""The lab's first request, one copy away: where the routers answer, the CA that signs their certificate, a router
client's key file, and a ``curl`` line that gets a completion through the virtual address.

All of it is read from the lab's inventory as a deploy reads it. curl takes the key from a header file the lab
keeps beside it (0600, ``Authorization: Bearer ...``): the key is on no command line and in no output.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from gpufleet.config.edge import ca_path
from gpufleet.config.inventory_shape import ROUTERS_GROUP
from gpufleet.config.secrets import read_secret
from gpufleet.config.settings.router import CLIENT_NAME
from gpufleet.inventory.load import load_fleet, loaded_inventory
from gpufleet.plan import virtual_address
from gpufleet.values.grammar import show
from gpufleet.values.problems import ConfigError
from gpufleet_lab.errors import LabInputError

PROMPT = "The fleet is"
MAX_TOKENS = 16


@dataclass(frozen=True)
class FirstRequest:
    """A router client's way in: the routers' base URL, a model it may ask for, the CA file, its key's file and the
    header file curl reads the key from."""

    url: str
    model: str
    client: str
    ca_file: str | None
    key_file: str
    headers_file: Path

    def curl(self) -> list[str]:
        """curl's words for one completion (``max_tokens`` :data:`MAX_TOKENS`)."""
        body = json.dumps({"model": self.model, "prompt": PROMPT, "max_tokens": MAX_TOKENS})
        trust = ["--cacert", self.ca_file] if self.ca_file else []
        return ["curl", "-sS", "--fail-with-body", *trust, "-H", f"@{self.headers_file}", "-H",
                "Content-Type: application/json", "-d", body, f"{self.url}/v1/completions"]

    def lines(self) -> list[str]:
        return [f"endpoint: {self.url}/v1 (model {json.dumps(self.model)})",
                f"CA: {self.ca_file or 'the system store'}",
                f"client key: {self.key_file} (client {self.client}; curl reads it from {self.headers_file}, 0600)",
                shlex.join(self.curl())]


def first_request(inventory: str, client: str) -> FirstRequest:
    """The way in for ``client`` (a key of ``router_clients``) to the routers of ``inventory``; writes its header
    file. LabInputError when the client's name cannot be one, the inventory cannot be read or has no routers, or no
    such client, or the key is not in a file."""
    if not CLIENT_NAME.match(client):
        raise LabInputError(f"--client: expected a client name (1-63 of letters, digits, '_', '.', '-', starting with a"
                            f" letter or digit), found {show(client)}")
    try:
        fleet = load_fleet(inventory)
    except ConfigError as error:
        raise LabInputError("; ".join(problem.line() for problem in error.problems)) from None
    loaded = loaded_inventory(fleet.hosts[0]) if fleet.hosts else None
    routers = next((list(m) for name, m in loaded.groups if name == ROUTERS_GROUP), []) if loaded else []
    if not routers:
        raise LabInputError(f"{inventory}: expected a routers group, found none")
    cfg = fleet.configs[routers[0]]
    known = sorted(cfg.router_clients)
    if client not in cfg.router_clients:
        raise LabInputError(f"--client: expected a router client of {inventory} ({', '.join(known) or 'none'}),"
                       f" found {client!r}")
    ref = cfg.router_clients[client].api_key
    if ref.file is None:
        raise LabInputError(f"router_clients.{client}.api_key: expected a file (curl reads the key from a file beside"
                       " it), found an environment variable")
    served = [fleet.configs[hosts[0]].served_model_name() for hosts in fleet.pools.values() if hosts]
    models = cfg.router_clients[client].models  # None: every served model
    allowed = [name for name in served if models is None or name in models]
    if not allowed:
        raise LabInputError(f"router client {client} may ask for no model the inventory serves")
    key_file = Path(ca_path(ref.file))
    headers = key_file.with_name(f"client-{client}.headers")
    try:
        key = read_secret(ref, f"router_clients.{client}.api_key")
    except ConfigError as error:
        raise LabInputError("; ".join(problem.line() for problem in error.problems)) from None
    _write_private(headers, f"Authorization: Bearer {key}\n")
    return FirstRequest(virtual_address.routers_url(routers, fleet.configs), allowed[0], client,
                        ca_path(cfg.router_tls_ca) if cfg.router_tls_ca else None, str(key_file), headers)


def _write_private(path: Path, text: str) -> None:
    """``text`` into ``path``, 0600 from its creation, replaced whole."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.unlink(missing_ok=True)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(temporary, path)
