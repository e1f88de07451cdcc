"""Role ``router``: HAProxy in front of the fleet's replicas, on the hosts of the inventory group ``routers``.

After it, a router host has:

- Debian's ``haproxy`` package, its ``haproxy.service`` running and enabled, with the drop-in
  ``/etc/systemd/system/haproxy.service.d/gpufleet.conf``: run as the ``haproxy`` account without any privilege,
  in gpufleet's sandbox, its sockets and pid file in ``/run/haproxy/``;
- ``/etc/haproxy/haproxy.cfg`` (root:haproxy, 0640), rendered from the plan and checked by ``haproxy -c`` before
  it replaces the one in use (a configuration HAProxy refuses never reaches the running router):

  - clients send OpenAI-style requests to ``router_listen_address:router_port``; the body is read whole (at most
    ``router_max_request_bytes``, else 413) and the request goes to the backend of its ``model``; a model no
    replica serves gets 404. ``GET /v1/models`` is answered by the router for every served model whose replicas
    accept the request's API key (the router holds only the SHA-256 of ``Bearer <key>``, never the key), and
    ``GET /health`` by the router itself (it is up);
  - only the routes of the model's task (:data:`gpufleet.plan.backends.TASK_ROUTES`) reach its replicas: every
    other path and method (``/invocations``, ``/tokenize``, ``/metrics``, ``/sleep``, ``/collective_rpc``, ...: vLLM
    checks its API key on ``/v1/`` routes only) is answered 404 by the router;
  - one backend per served model, holding its replicas (each replica's first node, its API port; the server is
    named after the replica), ``balance leastconn`` (``router_policy`` leastconn) or, with ``router_policy``
    prefix, the prefix's home (the replica that answered it first), else the one that answered it last (a table
    by the SHA-1 of a chat's system and first user message, a completion's first 256 bytes of prompt), while that
    replica is ready and within the bound ``router_prefix_balance``, else round robin, a health check
    ``GET /health`` every ``router_check_interval_s``, a request retried on another replica when its replica
    refused the connection, answered nothing or answered 503 (``router_retries``, ``option redispatch``), timeouts
    for long streams (``router_timeout_s``);
  - admission: each server takes at most the plan's ``maxconn`` of its replica at once
    (:mod:`gpufleet.plan.admission`); the other requests wait in the backend's queue, at most
    ``router_queue_timeout_s``, then get a 503 with ``Retry-After`` (every 503 the router makes itself does);
  - the runtime API on ``/run/haproxy/gpufleet-runtime.sock`` (0660, HAProxy's group: drain, weights, in-flight
    counts; the node tool ``router_admin.py`` speaks it);
  - HAProxy's Prometheus endpoint on ``<fleet address>:router_metrics_port/metrics``, for the router itself and
    the monitoring hosts only, and ``GET /health`` there (answered by HAProxy: what role keepalived checks);
  - with ``router_virtual_address`` (role keepalived), the client port on that address too, on every router
    (``transparent``: HAProxy binds it before keepalived brings it, so the router that takes it serves at once).
  - the edge (:func:`edge_files`, :func:`edge_values`): with ``router_clients``, the clients' keys checked by the
    router (401 without a known one, 403 for a model not allowed, 429 with ``Retry-After`` over a limit) from map
    files in ``EDGE_DIR`` (root:haproxy, 0640; the keys as SHA-256 only, the replicas' own key in ``upstream.map``,
    which replaces the client's on the way to a replica; in ``priorities.map`` the priority of each client's class),
    the clients' counters in the stick table
    ``gpufleet-clients``, written for node_exporter by ``gpufleet-router-clients.timer``
    (``router_admin.py client-metrics``); with ``router_tls_certificate`` and ``router_tls_key``, HTTPS on
    ``router_port`` from ``EDGE_DIR/router.pem`` (0640), plain HTTP only on ``router_plain_http_port`` when set.
  - each request's ``X-Vllm-Priority``, set by the router and never the client's (gpufleet.plan.priority): its
    client's class's where its model is scheduled by priority, else 0.
  - the routers' peers (:mod:`roles.router.peers`): every stick table shared with the other routers over TLS on
    ``router_peer_port`` and handed to the next process at a reload, with the routers' peer certificate in
    ``/etc/haproxy/gpufleet-peers.pem`` (root:haproxy, 0640; drawn by the deploy, the same on every router).

The configuration and the edge's files are written as candidates (:data:`CANDIDATE`, :data:`EDGE_CANDIDATE_DIR`),
checked together with ``haproxy -c`` and only then put in place (:func:`edge_install`): a file HAProxy refuses never
reaches the directory the running router reads. A change is reloaded (HAProxy's hitless reload: requests in flight
finish on the old workers; a new, removed or rotated client key changes only the edge's files); a changed drop-in
restarts HAProxy. Variables: roles/router/defaults.yml. The replicas let the routers in
(:func:`gpufleet.plan.access.vllm_sources`).
"""

from __future__ import annotations

import hashlib
import json
import math
import shlex
from collections.abc import Iterable, Mapping
from typing import Any

from pyinfra.api.deploy import deploy
from pyinfra.api.operation import OperationMeta
from pyinfra.context import host, state
from pyinfra.operations.util import any_changed

from gpufleet import templates
from gpufleet.config import edge
from gpufleet.config.inventory_shape import ROUTERS_GROUP
from gpufleet.config.schema import HostConfig
from gpufleet.config.settings.router import RouterClient
from gpufleet.netaddr import host_port
from gpufleet.node import router_health
from gpufleet.node_paths import NODE_PYTHON, NODE_TOOLS_DIR, ROUTER_ADMIN_SOCKET, TEXTFILE_DIR, node_tool, unit_path
from gpufleet.node_paths import ROUTER_SERVICE as SERVICE
from gpufleet.operations import apt, files, node, server, shared_secrets, systemd
from gpufleet.operations.server import checked_install  # shell text, not an operation
from gpufleet.plan import access
from gpufleet.plan.backends import Backend, backends, name_sha256
from gpufleet.plan.planner import FleetPlan, Replica
from gpufleet.plan.priority import DEFAULT_PRIORITY, PRIORITY_HEADER, client_priority
from gpufleet.run.context import context, host_config
from gpufleet.units.escape import exec_line
from gpufleet.values.problems import ConfigError, exit_with
from roles.router import peers, token_ledger
from roles.router.peers import Peers
from roles.vllm import replica_files as vf

PACKAGE = "haproxy"
CONFIG = "/etc/haproxy/haproxy.cfg"
CANDIDATE = "/etc/haproxy/gpufleet-candidate.cfg"  # checked with haproxy -c before it replaces CONFIG
DROP_IN_DIR = f"{unit_path(SERVICE)}.d"
DROP_IN = f"{DROP_IN_DIR}/gpufleet.conf"
HEADER_BYTES = 32768  # room in HAProxy's buffer for the request line and headers besides the body
TLS12_CIPHERS = ("ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-RSA-AES128-GCM-SHA256", "ECDHE-ECDSA-AES256-GCM-SHA384",
                 "ECDHE-RSA-AES256-GCM-SHA384", "ECDHE-ECDSA-CHACHA20-POLY1305", "ECDHE-RSA-CHACHA20-POLY1305")
"""TLS 1.2's ciphers at the edge: forward secrecy (ECDHE) and AEAD only, Mozilla's "intermediate" profile less its
DHE suites (which need parameters of their own); no static RSA key exchange, no CBC, no SHA-1."""
TLS13_SUITES = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256")
"""TLS 1.3's suites at the edge: all three of the standard's, every one forward secret and AEAD."""
# The edge (router_clients, TLS): files the deploy writes from the controller's secrets, read by HAProxy only.
EDGE_DIR = "/etc/haproxy/gpufleet-edge"  # root:haproxy 0750
EDGE_CANDIDATE_DIR = "/etc/haproxy/gpufleet-edge-candidate"  # the edge's files as written, checked before EDGE_DIR's
# <EDGE_DIR>/<name>.map, 0640
EDGE_MAPS = ("clients", "grants", "models", "rates", "concurrency", "priorities", "upstream", "budgets")
TLS_PEM = "router.pem"  # <EDGE_DIR>/router.pem: the certificate, its chain and its key, 0640
CLIENT_TABLE = "gpufleet-clients"  # the stick table of the clients' counters (gpufleet/node/router_admin.py reads it)
CLIENT_TABLE_SIZE = 10000
# router_policy prefix: each backend's table of keys (a prefix's SHA-1 -> its home and the replica that answered it
# last); an entry a key has not used for PREFIX_TABLE_EXPIRE is dropped, and the oldest go when it is full.
PREFIX_TABLE_SIZE = 200000  # keys (conversations, shared prompts) per model, about 30 MB at most
PREFIX_TABLE_EXPIRE = "1h"  # longer than a user reads an answer; vLLM's cache drops a prefix sooner under load
LIMIT_RETRY_AFTER_S = 1  # a client over its limit may try again after a second (rates are per second)
# The clients' counters for Prometheus: a timer has router_admin.py write them for node_exporter's textfile collector.
CLIENTS_SERVICE = "gpufleet-router-clients.service"
CLIENTS_TIMER = "gpufleet-router-clients.timer"
CLIENTS_TEXTFILE = f"{TEXTFILE_DIR}/gpufleet_router_clients.prom"
CLIENTS_INTERVAL_S = 15

NOT_FOUND = '{"error":{"message":"not found","type":"NotFoundError","code":404}}'
# What HAProxy answers itself with 503 (a request that waited router_queue_timeout_s for a free replica, or no
# replica up), with a Retry-After header.
# A body the router would read otherwise than vLLM: the router routes and authorises by the first "model" of a body,
# vLLM reads the last; and a key spelled with \u escapes ("\u006dodel") is "model" to vLLM, not to the router. No
# JSON encoder writes either: "model" twice with a value that is not an object or a list (a JSON schema's property
# named model is one), or printable ASCII (U+0020 to U+007E) as a \u escape (an odd run of backslashes before it),
# anywhere in the body. DEL (U+007F) is a control character, which encoders escape (Python's json does).
MODEL_TWICE = r'(^|[^\\])"model"\s*:\s*[^\s{\[][\s\S]*(^|[^\\])"model"\s*:\s*[^\s{\[]'
ESCAPED_ASCII = r'(^|[^\\])(\\\\)*\\u00([2-6][0-9a-fA-F]|7[0-9a-eA-E])'
AMBIGUOUS = ('{"error":{"message":"the body names its model twice, or spells printable characters as unicode escapes;'
             ' send it as plain JSON","type":"BadRequestError","code":400}}')
UNAVAILABLE = ('{"error":{"message":"every replica of the model is busy or down; retry later",'
               '"type":"ServiceUnavailableError","code":503}}')
UNAUTHORIZED = ('{"error":{"message":"a known API key is needed (Authorization: Bearer <key>)",'
                '"type":"AuthenticationError","code":401}}')
FORBIDDEN = '{"error":{"message":"this API key may not use this model","type":"PermissionDeniedError","code":403}}'
LIMITED = ('{"error":{"message":"over the limit of requests per second or at once of this API key; retry later",'
           '"type":"RateLimitError","code":429}}')


# --- what the router gets, as plain data (tested without a node) --------------------------------------------------

def replica_maxconn(replicas: Iterable[Replica]) -> dict[str, int]:
    """Each replica's ``maxconn`` at the router, by its name (its server's): the plan's admission."""
    return {replica.name: replica.admission.maxconn for replica in replicas}


def key_sha256(api_key: str | None) -> str | None:
    """The SHA-256 (hex) of the Authorization header that carries ``api_key``; None without a key."""
    return hashlib.sha256(f"Bearer {api_key}".encode()).hexdigest() if api_key else None


def model_lists(models_by_key: dict[str | None, list[str]]) -> list[dict[str, str | None]]:
    """The ``GET /v1/models`` answers: for each API key (its header's SHA-256; None: no key needed) the models it
    opens, and the open models in every keyed answer too. The keyed answers come first."""
    open_models = models_by_key.get(None, [])
    answers: list[dict[str, str | None]] = []
    for digest in sorted(d for d in models_by_key if d is not None):
        answers.append({"key_sha256": digest, "body": _models_body(sorted({*models_by_key[digest], *open_models}))})
    if open_models or not answers:
        answers.append({"key_sha256": None, "body": _models_body(sorted(open_models))})
    return answers


def _models_body(models: list[str]) -> str:
    """OpenAI's model list as compact ASCII JSON without a single quote (it is written inside HAProxy's '...')."""
    data = [{"id": m, "object": "model", "owned_by": "gpufleet"} for m in models]
    return json.dumps({"object": "list", "data": data}, separators=(",", ":")).replace("'", "\\u0027")


def retry_after_s(cfg: HostConfig) -> int:
    """The ``Retry-After`` of the router's own 503s: the queue timeout, in whole seconds (at least 1)."""
    return max(1, math.ceil(cfg.router_queue_timeout_s))


def replica_agents(plan: FleetPlan, configs: Mapping[str, HostConfig]) -> dict[str, int]:
    """The port of the node watch's agent (role node_lifecycle) on each replica's first node, by the replica's name;
    replicas whose first node runs no watch are left out."""
    return {replica.name: configs[replica.nodes[0]].node_agent_port for replica in plan.replicas
            if replica.nodes and configs[replica.nodes[0]].node_lifecycle_enabled}


def config_values(cfg: HostConfig, address: str, found: list[Backend], lists: list[dict[str, str | None]],
                  metrics_allowed: list[str], maxconn: Mapping[str, int], edge_dir: str = EDGE_DIR,
                  agents: Mapping[str, int] | None = None, peers: Peers | None = None) -> dict[str, Any]:
    """What templates/router/haproxy.cfg.j2 is rendered with; ``maxconn``: each replica's, by name
    (:func:`replica_maxconn`); ``edge_dir``: where the edge's files are (:func:`edge_values`); ``agents``: the agent
    port of each replica's node watch, by name (:func:`replica_agents`); ``peers``: the routers' peers section
    (:mod:`roles.router.peers`; None: tables of this process alone)."""
    agents = agents or {}
    listen_address = cfg.router_listen_address or address
    return {
        **edge_values(cfg, listen_address, edge_dir),
        "listen": host_port(listen_address, cfg.router_port),
        "virtual_listen": virtual_listen(cfg),
        "metrics_listen": host_port(address, cfg.router_metrics_port),
        "metrics_allowed": ["127.0.0.1", "::1", *metrics_allowed],
        "admin_socket": ROUTER_ADMIN_SOCKET,
        "max_connections": cfg.router_max_connections,
        "max_request_bytes": cfg.router_max_request_bytes,
        "buffer_bytes": cfg.router_max_request_bytes + HEADER_BYTES,
        "tls12_ciphers": ":".join(TLS12_CIPHERS),
        "tls13_suites": ":".join(TLS13_SUITES),
        "timeout_s": cfg.router_timeout_s,
        "connect_timeout_s": cfg.router_connect_timeout_s,
        "queue_timeout_ms": max(1, round(cfg.router_queue_timeout_s * 1000)),
        "retry_after_s": retry_after_s(cfg),
        "unavailable": UNAVAILABLE,
        "retries": cfg.router_retries,
        "check_interval_s": cfg.router_check_interval_s,
        "check_fall": cfg.router_check_fall,
        "check_rise": cfg.router_check_rise,
        "model_lists": lists,
        "peers": peers,
        "tokens": token_ledger.config_values(cfg),
        "priority_header": PRIORITY_HEADER,
        "default_priority": DEFAULT_PRIORITY,
        "prefix_table_size": PREFIX_TABLE_SIZE,
        "prefix_table_expire": PREFIX_TABLE_EXPIRE,
        "not_found": NOT_FOUND,
        "ambiguous": AMBIGUOUS,
        "model_twice": MODEL_TWICE,
        "escaped_ascii": ESCAPED_ASCII,
        "backends": [{"name": b.name, "comment": b.comment, "model_sha256": b.model_sha256, "routes": b.routes,
                      "adapters": [{"sha256": name_sha256(name), "order": b.adapter_order(name)}
                                   for name, _ in b.adapters],
                      "policy": b.policy, "bound_percent": b.bound_percent, "priority": b.priority,
                      "metered": b.metered, "fair": b.fair,
                      "servers": [{"name": n, "address": a, "maxconn": maxconn[n], "agent_port": agents.get(n),
                                   "id": b.server_ids[n]} for n, a in b.servers]}
                     for b in found],
    }


def virtual_listen(cfg: HostConfig) -> str | None:
    """The client port on the routers' virtual address (role keepalived), bound on every router whether it holds
    the address or not; None without one, or when the client port listens on every IPv4 address already."""
    if cfg.router_virtual_address is None or cfg.router_listen_address == "0.0.0.0":
        return None
    return host_port(cfg.router_virtual_address, cfg.router_port)


def edge_maps(clients: Mapping[str, RouterClient], keys: Mapping[str, str], found: list[Backend],
              upstream: Mapping[str, str | None]) -> dict[str, str]:
    """The edge's map files by name (:data:`EDGE_MAPS`): ``clients`` (the SHA-256 of each client's Authorization
    header -> client), ``grants`` (``client/<model's SHA-256>`` -> 1 for each served model the client may use),
    ``models`` (client -> its ``GET /v1/models`` answer), ``rates`` and ``concurrency`` (client -> its limit, where it
    has one), ``priorities`` (client -> the priority vLLM schedules its requests by where its model is scheduled by
    priority: gpufleet.plan.priority), ``budgets`` (client -> 1 where it has a token budget: roles.router.token_ledger),
    ``upstream`` (model's SHA-256 -> the Authorization header its replicas take,
    where they have a key).
    ``keys``: each client's key by name; ``upstream``: each served model's replicas' key (None: none)."""
    header = "# Written by gpufleet (role router) from router_clients: read by HAProxy only.\n"
    maps = {name: [header] for name in EDGE_MAPS}
    served = {name: backend for backend in found for name in backend.names}
    for name in sorted(clients):
        client = clients[name]
        models = sorted(served if client.models is None else set(client.models) & set(served))
        maps["clients"].append(f"{key_sha256(keys[name])} {name}\n")
        maps["grants"] += [f"{name}/{name_sha256(model)} 1\n" for model in models]
        maps["models"].append(f"{name} {_models_body(models)}\n")
        if client.requests_per_s is not None:
            maps["rates"].append(f"{name} {client.requests_per_s}\n")
        if client.concurrent_requests is not None:
            maps["concurrency"].append(f"{name} {client.concurrent_requests}\n")
        maps["priorities"].append(f"{name} {client_priority(client)}\n")
        if client.metered:
            maps["budgets"].append(f"{name} 1\n")
    for backend in found:
        if key := upstream.get(backend.model):
            maps["upstream"] += [f"{name_sha256(each)} Bearer {key}\n" for each in backend.names]
    return {name: "".join(lines) for name, lines in maps.items()}


def upstream_keys(plan: FleetPlan) -> dict[str, str | None]:
    """Each served model's replicas' API key (read on the controller; None: they take none): its first replica's,
    which every other one takes (the inventory's checks refuse a model whose replicas take several with
    router_clients: gpufleet.config.edge)."""
    return {model.name: vf.api_key(model.api_keys[0]) for model in plan.models.values()}


def edge_files(cfg: HostConfig, found: list[Backend], upstream: Mapping[str, str | None]) -> dict[str, str]:
    """Every file of :data:`EDGE_DIR` by name, from the controller's secrets: the maps with clients
    (:func:`edge_maps`), the PEM with TLS. ConfigError (no secret shown) when a secret cannot be read."""
    written = {}
    if cfg.router_clients:
        maps = edge_maps(cfg.router_clients, edge.client_keys(cfg), found, upstream)
        written.update({f"{name}.map": text for name, text in maps.items()})
    if (pem := edge.tls_pem(cfg)) is not None:
        written[TLS_PEM] = pem
    return written


def edge_values(cfg: HostConfig, listen_address: str, edge_dir: str = EDGE_DIR) -> dict[str, Any]:
    """The template's values for the edge: the maps' and the PEM's paths when ``cfg`` has clients or TLS, and
    the plain HTTP port beside TLS on ``listen_address``."""
    return {
        "edge": {**{name: f"{edge_dir}/{name}.map" for name in EDGE_MAPS}, "table": CLIENT_TABLE,
                 "table_size": CLIENT_TABLE_SIZE, "retry_after_s": LIMIT_RETRY_AFTER_S,
                 "unauthorized": UNAUTHORIZED, "forbidden": FORBIDDEN, "limited": LIMITED}
                if cfg.router_clients else None,
        "tls_pem": f"{edge_dir}/{TLS_PEM}" if cfg.router_tls_certificate is not None else None,
        "plain_listen": host_port(listen_address, cfg.router_plain_http_port)
                        if cfg.router_plain_http_port is not None else None,
    }


def render(values: dict[str, Any]) -> str:
    """The configuration text exactly as the deploy writes it."""
    return templates.render("router/haproxy.cfg.j2", **values)


def open_files(cfg: HostConfig) -> int:
    """HAProxy's file descriptor limit: two per connection (client and replica) and room for checks and sockets."""
    return 2 * cfg.router_max_connections + 1024


def restart_after_s(cfg: HostConfig) -> float | None:
    """How long systemd waits before it starts a HAProxy that died again (None: Debian's 100 ms). Behind a virtual
    address, two of its health checks' intervals: the check sees nothing listening (a refused connection fails at
    once), keepalived hands the address to a router that serves, and this one comes back a backup. Restarted at once,
    HAProxy would be back between two checks as often as not, and the address would stay on the router whose crash
    cut its connections."""
    return None if cfg.router_virtual_address is None else 2 * router_health.INTERVAL_S


def drop_in(cfg: HostConfig) -> str:
    return templates.render("router/haproxy-override.conf.j2", open_files=open_files(cfg), ip_access="",
                            restart_after_s=restart_after_s(cfg))


def clients_service_values(cfg: HostConfig) -> dict[str, object]:
    """What templates/router/gpufleet-router-clients.service.j2 is rendered with (the same on every router): with a
    metered client, the token ledger's counters too."""
    argv = [NODE_PYTHON, "-I", node_tool("router_admin.py"), "client-metrics", "--textfile", CLIENTS_TEXTFILE,
            "--socket", ROUTER_ADMIN_SOCKET, "--edge-dir", EDGE_DIR,
            *(["--ledger", str(cfg.router_ledger_port)] if token_ledger.runs(cfg) else [])]
    return {"timer": CLIENTS_TIMER, "node_tools": NODE_TOOLS_DIR, "textfile": CLIENTS_TEXTFILE,
            "textfile_dir": f"-{TEXTFILE_DIR}",  # "-": no error where node_exporter is not installed
            "exec_start": exec_line(argv), "ip_access": access.unit_lines([])}  # localhost only: no network


def clients_timer_values() -> dict[str, object]:
    return {"service": CLIENTS_SERVICE, "interval": CLIENTS_INTERVAL_S}


def fleet_values(cfg: HostConfig, address: str) -> dict[str, Any]:
    """:func:`config_values` for the running deploy: the plan's replicas, their API keys (read on the controller),
    the monitoring hosts. Exits 2 on bad input."""
    ctx = context()
    try:
        found = backends(ctx.plan)
        by_key: dict[str | None, list[str]] = {}
        for model in ctx.plan.models.values():
            for ref in model.api_keys:
                by_key.setdefault(key_sha256(vf.api_key(ref)), []).extend(model.names)
        metrics_allowed = access.exporter_sources(cfg, address, access.deploy_group())
    except ConfigError as error:
        exit_with(error)
    return config_values(cfg, address, found, model_lists(by_key), metrics_allowed, replica_maxconn(ctx.plan.replicas),
                         agents=replica_agents(ctx.plan, ctx.fleet.configs),
                         peers=peers.peers(host.name, fleet_routers(), ctx.fleet.configs))


def fleet_edge_files(cfg: HostConfig) -> dict[str, str]:
    """:func:`edge_files` for the running deploy (secrets read on the controller). Exits 2 on bad input."""
    ctx = context()
    try:
        return edge_files(cfg, backends(ctx.plan), upstream_keys(ctx.plan) if cfg.router_clients else {})
    except ConfigError as error:
        exit_with(error)


def edge_install(names: list[str], stale: list[str]) -> str:
    """The shell text that puts the configuration and the edge's files in place once HAProxy accepted them together:
    ``haproxy -c`` on :data:`CANDIDATE` with :data:`EDGE_CANDIDATE_DIR` mounted over :data:`EDGE_DIR` (in a mount
    namespace of its own, which nothing else sees), then each of ``names`` installed from the candidates and renamed
    into :data:`EDGE_DIR` (a reader never sees half a file), the ``stale`` files removed, and the configuration
    installed last; without edge files, :data:`EDGE_DIR` goes once the configuration that used it is replaced."""
    candidate, edge_dir, cand_dir = shlex.quote(CANDIDATE), shlex.quote(EDGE_DIR), shlex.quote(EDGE_CANDIDATE_DIR)
    check = f"haproxy -c -q -f {candidate}"
    if not names:
        return f"{checked_install(check, CANDIDATE, CONFIG, 'haproxy')}; rm -rf -- {edge_dir}"
    inner = shlex.quote(f"mount --bind {cand_dir} {edge_dir} && {check}")
    moves = "; ".join(
        f"install -o root -g haproxy -m 0640 {shlex.quote(f'{EDGE_CANDIDATE_DIR}/{name}')}"
        f" {shlex.quote(f'{EDGE_DIR}/.{name}.gpufleet-new')}; "
        f"mv -fT {shlex.quote(f'{EDGE_DIR}/.{name}.gpufleet-new')} {shlex.quote(f'{EDGE_DIR}/{name}')}"
        for name in names)
    removed = f"; rm -rf -- {' '.join(shlex.quote(path) for path in stale)}" if stale else ""
    return (f"set -e; unshare --mount --propagation private sh -c {inner}; {moves}{removed}; "
            f"{checked_install('true', CANDIDATE, CONFIG, 'haproxy')}")


def _edge_in_place(wanted: Mapping[str, str]) -> bool:
    """Whether :data:`EDGE_DIR` holds exactly the wanted edge files (none: it is gone), as the deploy began."""
    if not wanted:
        return node.path(EDGE_DIR)["type"] == "missing"
    return not _stale_edge_files(wanted) and all(
        node.path(f"{EDGE_DIR}/{name}").get("sha256") == hashlib.sha256(content.encode()).hexdigest()
        for name, content in wanted.items())


def _stale_edge_files(wanted: Mapping[str, str]) -> list[str]:
    """What :data:`EDGE_DIR` holds beyond the wanted edge files."""
    if not wanted:
        return []
    keep = {f"{EDGE_DIR}/{name}" for name in wanted}
    return [path for path in node.listing(f"{EDGE_DIR}/*") if path not in keep]


# --- the deploy ----------------------------------------------------------------------------------------------------

def is_router() -> bool:
    """Whether the current host is in the inventory group ``routers``."""
    return ROUTERS_GROUP in host.groups


def fleet_routers() -> list[str]:
    """The hosts of the inventory group ``routers``, in its order."""
    return [member.name for member in state.inventory.get_group(ROUTERS_GROUP)]


@deploy("Router (HAProxy)")
def router() -> None:
    """Converge HAProxy on a router host: the package, the sandboxed unit, the configuration from the plan, the
    edge's files (client keys, TLS) and the clients' counters."""
    if not is_router():
        return
    cfg = host_config()
    address = cfg.fleet_address or host.name
    text = render(fleet_values(cfg, address))
    wanted = hashlib.sha256(text.encode()).hexdigest()
    edge_wanted = fleet_edge_files(cfg)
    clients_service, clients_timer = unit_path(CLIENTS_SERVICE), unit_path(CLIENTS_TIMER)
    node.observe(name="Read the router's package, units, configuration, edge and token ledger files",
                 packages=[PACKAGE], units=[SERVICE, CLIENTS_TIMER, token_ledger.SERVICE],
                 paths=[CONFIG, CANDIDATE, DROP_IN_DIR, DROP_IN, EDGE_DIR, EDGE_CANDIDATE_DIR, peers.PEM,
                        clients_service, clients_timer, token_ledger.LUA, token_ledger.BUDGETS,
                        unit_path(token_ledger.SERVICE),
                        *(f"{folder}/{name}" for folder in (EDGE_DIR, EDGE_CANDIDATE_DIR) for name in edge_wanted)],
                 listings=[f"{EDGE_DIR}/*", f"{EDGE_CANDIDATE_DIR}/*"])
    apt.packages(name="Install HAProxy (the distribution's package)", packages=[PACKAGE], update_first=True)
    files.directory(name=f"Create {DROP_IN_DIR}", path=DROP_IN_DIR)
    unit = files.file(name=f"Write the drop-in {DROP_IN} (account, sockets, sandbox)", dest=DROP_IN,
                      content=drop_in(cfg))
    systemd.daemon_reload(name="Reload systemd: HAProxy's drop-in changed", _if=unit.did_change)
    if edge_wanted:
        for folder in (EDGE_CANDIDATE_DIR, EDGE_DIR):
            files.directory(name=f"Create {folder} (root:haproxy, 0750)", path=folder, group="haproxy", mode="0750")
        for name, content in sorted(edge_wanted.items()):
            files.secret_file(name=f"Write the edge's {name} as a candidate (root:haproxy, 0640)",
                              dest=f"{EDGE_CANDIDATE_DIR}/{name}", content=content, mode="0640", group="haproxy")
        files.pruned(name=f"Remove what the edge no longer uses from {EDGE_CANDIDATE_DIR}",
                     pattern=f"{EDGE_CANDIDATE_DIR}/*", keep=[f"{EDGE_CANDIDATE_DIR}/{n}" for n in edge_wanted])
    else:
        files.absent(name=f"Remove {EDGE_CANDIDATE_DIR}: no clients, no TLS", path=EDGE_CANDIDATE_DIR)
    pem = _peer_pem()
    lua = _token_ledger(cfg)
    files.file(name=f"Write the router's configuration to check ({CANDIDATE})", dest=CANDIDATE, content=text,
               group="haproxy", mode="0640")
    config = server.script(
        name=f"Check the configuration with the edge's candidate files (haproxy -c), then put them in place ({CONFIG},"
             f" {EDGE_DIR})",
        script=edge_install(sorted(edge_wanted), _stale_edge_files(edge_wanted)),
        done_file=CONFIG, done_sha256=wanted, pending=not _edge_in_place(edge_wanted),
    )
    systemd.restart(name=f"Restart {SERVICE}: its drop-in changed", unit=SERVICE, _if=unit.did_change)
    systemd.reload(name=f"Reload {SERVICE}: its configuration, edge files or peer certificate changed (requests in"
                        " flight finish)", unit=SERVICE, _if=any_changed(config, pem, lua))
    systemd.service(name=f"Ensure {SERVICE} runs and starts at boot", unit=SERVICE, running=True, enabled=True)
    _clients_counters(cfg, clients_service, clients_timer)


def _peer_pem() -> OperationMeta:
    """The routers' peer certificate and key (:mod:`roles.router.peers`): read on every router, then kept while they
    agree, else drawn once and written on all of them (a new one reloads HAProxy)."""
    ctx = context()
    found = ctx.shared_secrets_seen.setdefault(peers.PEM, {})
    shared_secrets.seen(name=f"Read {peers.WHAT}'s digest", path=peers.PEM, found=found, what=peers.WHAT)
    return shared_secrets.kept(name=f"Keep {peers.WHAT} ({peers.PEM}, root:haproxy 0640, the same on every router)",
                               what=peers.WHAT, path=peers.PEM, holders=fleet_routers(), found=found,
                               draw=peers.draw_pem, chosen=ctx.shared_secrets, group="haproxy", mode="0640")


def _token_ledger(cfg: HostConfig) -> OperationMeta:
    """The token ledger with a metered or sharing client (:mod:`roles.router.token_ledger`): its budgets, its unit,
    running, and the Lua HAProxy loads to ask it; all gone without. Returns the Lua file's operation (a change reloads
    HAProxy)."""
    unit_file = unit_path(token_ledger.SERVICE)  # read with the router's other files (router())
    if not token_ledger.runs(cfg):
        systemd.service(name=f"Stop and disable {token_ledger.SERVICE} (no client has a token budget or a share)",
                        unit=token_ledger.SERVICE, running=False, enabled=False)
        removed = [files.absent(name=f"Remove {path} (no client has a token budget or a share)", path=path)
                   for path in (unit_file, token_ledger.BUDGETS)]
        systemd.daemon_reload(name="Reload systemd: the token ledger's unit is gone", _if=removed[0].did_change)
        return files.absent(name=f"Remove {token_ledger.LUA} (no client has a token budget or a share)",
                            path=token_ledger.LUA)
    ctx = context()
    found = backends(ctx.plan)
    budgets = files.file(name=f"Write the token budgets ({token_ledger.BUDGETS})", dest=token_ledger.BUDGETS,
                         content=token_ledger.budgets(cfg, found, replica_maxconn(ctx.plan.replicas)),
                         mode="0644")
    unit = files.file(name=f"Write {unit_file} (the token ledger)", dest=unit_file,
                      content=templates.render("router/gpufleet-token-ledger.service.j2",
                                               **token_ledger.service_values(host.name, fleet_routers(),
                                                                             ctx.fleet.configs)))
    systemd.daemon_reload(name="Reload systemd: the token ledger's unit changed", _if=unit.did_change)
    systemd.restart(name=f"Restart {token_ledger.SERVICE}: its unit changed (it takes the others' state back)",
                    unit=token_ledger.SERVICE, _if=unit.did_change)
    systemd.reload(name=f"Reload {token_ledger.SERVICE}: the budgets changed (what each client used is kept)",
                   unit=token_ledger.SERVICE, _if=lambda: budgets.did_change() and not unit.did_change())
    systemd.service(name=f"Ensure {token_ledger.SERVICE} runs and starts at boot", unit=token_ledger.SERVICE,
                    running=True, enabled=True)
    return files.file(name=f"Write {token_ledger.LUA} (HAProxy asks the token ledger with it)", dest=token_ledger.LUA,
                      content=token_ledger.lua(cfg), mode="0644")


def _clients_counters(cfg: HostConfig, service_file: str, timer_file: str) -> None:
    """The timer that writes the clients' counters for node_exporter, with clients; gone without."""
    if cfg.router_clients:
        service = files.file(name=f"Write {service_file} (the clients' counters)", dest=service_file,
                             content=templates.render("router/gpufleet-router-clients.service.j2",
                                                      **clients_service_values(cfg)))
        timer = files.file(name=f"Write {timer_file}: the counters every {CLIENTS_INTERVAL_S} s", dest=timer_file,
                           content=templates.render("router/gpufleet-router-clients.timer.j2",
                                                    **clients_timer_values()))
        systemd.daemon_reload(name="Reload systemd: the clients' counters' units changed",
                              _if=any_changed(service, timer))
        systemd.service(name=f"Enable and start {CLIENTS_TIMER}", unit=CLIENTS_TIMER, running=True, enabled=True)
        return
    systemd.service(name=f"Stop and disable {CLIENTS_TIMER} (no router_clients)", unit=CLIENTS_TIMER,
                    running=False, enabled=False)
    removed = [files.absent(name=f"Remove {path} (no router_clients)", path=path)
               for path in (timer_file, service_file, CLIENTS_TEXTFILE)]
    systemd.daemon_reload(name="Reload systemd: the clients' counters' units are gone", _if=any_changed(*removed[:2]))
