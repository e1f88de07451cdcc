"""The routers' token ledger (gpufleet/node/token_ledger.py) on each router, where a client has a token budget or a
share: its budgets file, its unit, and the Lua HAProxy asks it with.

The ledger listens on loopback for this router's HAProxy and on the fleet address for the other routers' ledgers
(``router_ledger_port``, TLS with the routers' peer certificate: :mod:`roles.router.peers`). The group ``routers``
in its order is the authority's order: the first router whose ledger answers decides for all.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from gpufleet import templates
from gpufleet.config.schema import HostConfig
from gpufleet.netaddr import host_port
from gpufleet.node_paths import CONFIG_DIR, NODE_PYTHON, NODE_TOOLS_DIR, node_tool
from gpufleet.plan import access
from gpufleet.plan.backends import Backend
from gpufleet.plan.priority import client_priority
from gpufleet.units.escape import exec_line
from roles.common import NODE_SOURCES
from roles.router.peers import PEM, router_host

SERVICE = "gpufleet-token-ledger.service"
BUDGETS = f"{CONFIG_DIR}/token-budgets.json"  # root 0644: client names and numbers, no key
LUA = "/etc/haproxy/gpufleet-tokens.lua"  # root 0644
STATE_DIR = "gpufleet-token-ledger"  # its StateDirectory=, below /var/lib
STATE = f"/var/lib/{STATE_DIR}/state.json"  # what it saved when it stopped
CALL_TIMEOUT_MS = 2000  # HAProxy's call to the ledger; the ledger's own forward to another router takes 1 s at most
FLUSH_MS = 20  # settlements are sent in a batch this often
HOLD_MARGIN_S = 60  # a reservation unsettled for the router's timeout and this long is charged whole
AWAY = ('{"error":{"message":"the token budgets cannot be checked now; retry in a second",'
        '"type":"ServiceUnavailableError","code":503}}')
NEVER = ('{"error":{"message":"this request may cost more tokens than the whole budget of this API key (lower'
         ' max_tokens)","type":"BadRequestError","code":400}}')
LIMITED = ('{"error":{"message":"over the token budget of this API key; retry after the seconds in Retry-After",'
           '"type":"RateLimitError","code":429}}')


def runs(cfg: HostConfig) -> bool:
    """Whether the token ledger runs: a client of the routers has a token budget or a share."""
    return any(client.metered or client.share is not None for client in cfg.router_clients.values())


def budgets(cfg: HostConfig, found: Sequence[Backend], maxconn: Mapping[str, int]) -> str:
    """The ledger's budgets file: each metered client's budgets, the token weights, each client's share and class
    (the priority vLLM schedules it by: the fair queue's order before counters), each metered or shared backend's
    served model (the ledger's metrics label) and max_model_len (what a request without max_tokens reserves), and
    each shared backend's slots (its replicas' maxconn, by name in ``maxconn``, together: what the fair queue lets
    through at once) and how long a request waits in it at most (the router's queue timeout)."""
    shared = any(b.fair for b in found)
    document = {
        "clients": {name: {"tokens_per_minute": c.tokens_per_minute, "tokens_per_day": c.tokens_per_day}
                    for name, c in sorted(cfg.router_clients.items()) if c.metered},
        "weights": {"prompt": cfg.router_token_weights.prompt, "completion": cfg.router_token_weights.completion},
        "shares": {name: c.share for name, c in sorted(cfg.router_clients.items()) if c.share is not None},
        "classes": {name: client_priority(c) for name, c in sorted(cfg.router_clients.items()) if shared},
        "models": {b.name: b.model for b in found if b.metered or b.fair},
        "max_tokens": {b.name: b.max_model_len for b in found if b.metered or b.fair},
        "hold_s": cfg.router_timeout_s + HOLD_MARGIN_S,
        "slots": {b.name: sum(maxconn[name] for name, _ in b.servers) for b in found if b.fair},
        "queue_s": cfg.router_queue_timeout_s,
    }
    return json.dumps(document, indent=1, sort_keys=True) + "\n"


def ledger_address(router: str, cfg: HostConfig) -> str:
    """Where the other routers' ledgers reach ``router``'s."""
    return host_port(router_host(router, cfg), cfg.router_ledger_port)


def service_values(router: str, routers: Sequence[str], configs: Mapping[str, HostConfig]) -> dict[str, Any]:
    """What templates/router/gpufleet-token-ledger.service.j2 is rendered with, on ``router``: it names the tool's
    SHA-256, so that a new tool changes the unit, which restarts it (it takes the other routers' state back)."""
    cfg = configs[router]
    listen = host_port("127.0.0.1", cfg.router_ledger_port)
    addresses = [ledger_address(name, configs[name]) for name in routers]
    argv = [NODE_PYTHON, "-I", node_tool("token_ledger.py"), "--budgets", BUDGETS, "--listen", listen,
            "--routers", ",".join(addresses), "--self", str(list(routers).index(router)), "--pem", PEM,
            "--state", STATE]
    others = [router_host(name, configs[name]) for name in routers if name != router]
    tool = hashlib.sha256((NODE_SOURCES / "token_ledger.py").read_bytes()).hexdigest()
    return {"node_tools": NODE_TOOLS_DIR, "listen": listen, "peer_listen": addresses[list(routers).index(router)],
            "budgets": BUDGETS, "exec_start": exec_line(argv), "ip_access": access.unit_lines(others),
            "tool_sha256": tool, "state_dir": STATE_DIR}


def lua(cfg: HostConfig) -> str:
    """The Lua HAProxy loads to ask the ledger (templates/router/gpufleet-tokens.lua.j2); a reservation's call may
    wait for the request's turn in the fair queue, the router's queue timeout at most."""
    return templates.render("router/gpufleet-tokens.lua.j2", ledger=host_port("127.0.0.1", cfg.router_ledger_port),
                            timeout_ms=CALL_TIMEOUT_MS, flush_ms=FLUSH_MS,
                            reserve_timeout_ms=CALL_TIMEOUT_MS + math.ceil(cfg.router_queue_timeout_s * 1000))


def config_values(cfg: HostConfig) -> dict[str, Any] | None:
    """The router configuration's ``tokens`` values; None where the ledger does not run."""
    if not runs(cfg):
        return None
    return {"lua": LUA, "away": AWAY, "never": NEVER, "limited": LIMITED}
