"""The router's edge across the fleet: client keys and TLS, read on the controller and checked before any host.

What one host's schema cannot see: a client allowed a model no pool serves, two clients with one key (the
resolved keys are compared, never shown), a key or TLS file the controller cannot read, a certificate without
its key or with another (the pair is parsed: :mod:`gpufleet.config.tls_pair`), a plain HTTP port without TLS or
on another port's number, a CA file for clients that is not one. The router role reads the same secrets through
:func:`client_keys` and :func:`tls_pem`.
"""

from __future__ import annotations

import ssl
import stat
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gpufleet.config.layers import HostLayers, Layer, is_role_default
from gpufleet.config.router_wide import address_problems, pool_read_problems, router_wide_problems, wide_networks
from gpufleet.config.schema import HostConfig
from gpufleet.config.secrets import read_secret
from gpufleet.config.settings.router import MIN_KEY_CHARS
from gpufleet.config.tls_pair import is_ip_address, pair_problems
from gpufleet.values.grammar import show
from gpufleet.values.problems import HIDDEN_KEY, ConfigError, Problem
from gpufleet.values.types import SecretRef

MAX_KEY_CHARS = 4096
"""The longest client key: its ``Authorization`` header shares the 32 KiB the routers' buffer keeps for a request's
line and headers (roles/router HEADER_BYTES); an eighth of it leaves the rest to the request's other headers."""

CERTIFICATE_MARK = "-----BEGIN CERTIFICATE-----"
PRIVATE_KEY_MARK = "PRIVATE KEY-----"


def _key_problem(value: str) -> str | None:
    """Why a client key cannot be one (it must travel in ``Authorization: Bearer <key>``), without showing it."""
    if len(value) < MIN_KEY_CHARS or not all("!" <= ch <= "~" for ch in value):
        return (f"expected a key of at least {MIN_KEY_CHARS} visible ASCII characters without blanks,"
                " found one that is not (not shown)")
    if len(value) > MAX_KEY_CHARS:
        return (f"expected a key of at most {MAX_KEY_CHARS:,} characters (it travels in a header the routers"
                f" buffer), found {len(value):,} (not shown)")
    return None


def client_keys(cfg: HostConfig) -> dict[str, str]:
    """Each client's key by client name, read from its reference; ConfigError (the first problem of each
    client, no key shown) when one is unreadable, not a key, or another client's too."""
    cache: _Read = {}
    problems = [Problem(source, key, message) for source, key, message in _client_problems(cfg, {}, cache)]
    if problems:
        raise ConfigError(problems)
    return {name: str(cache[client.api_key]) for name, client in cfg.router_clients.items()}


def tls_pem(cfg: HostConfig) -> str | None:
    """The router's certificate (with its chain) and private key as one PEM, as HAProxy's ``crt`` reads it; None
    without TLS. ConfigError when either is unreadable or not PEM."""
    problems = [Problem(source, key, message) for source, key, message in _tls_problems(cfg, {}, {})]
    if problems:
        raise ConfigError(problems)
    if cfg.router_tls_certificate is None or cfg.router_tls_key is None:
        return None
    return f"{read_secret(cfg.router_tls_certificate, 'router_tls_certificate', one_line=False)}\n" \
           f"{read_secret(cfg.router_tls_key, 'router_tls_key', one_line=False)}\n"


_Read = dict[SecretRef, "str | ConfigError"]


def _read(ref: SecretRef, key: str, cache: _Read) -> str | ConfigError:
    if ref not in cache:
        try:
            cache[ref] = read_secret(ref, key, one_line=False)  # PEM; a client key's text: _key_problem
        except ConfigError as error:
            cache[ref] = error
    return cache[ref]


def _unreadable(error: ConfigError, source: str, key: str) -> tuple[str, str, str]:
    return source, key, error.problems[0].message


def _client_problems(cfg: HostConfig, sources: dict[str, str], cache: _Read) -> Iterator[tuple[str, str, str]]:
    """(source, key path, problem) for the clients' keys."""
    source = sources.get("router_clients", "controller")
    owner: dict[str, str] = {}
    for name, client in cfg.router_clients.items():
        key = f"router_clients.{name}.api_key"
        value = _read(client.api_key, key, cache)
        if isinstance(value, ConfigError):
            yield _unreadable(value, source, key)
        elif problem := _key_problem(value):
            yield source, key, problem
        elif value in owner:
            yield source, key, f"expected a key of its own per client, found client {owner[value]}'s key (not shown)"
        else:
            owner[value] = name
    for name in cfg.router_clients:
        if name in owner:  # a name is shown everywhere (messages, a label of its metrics): never a key
            yield source, f"router_clients.{HIDDEN_KEY}", ("expected a client name that is no key (a name is a label"
                                                          " of its metrics), found a name that is a client's key"
                                                          " (not shown)")


def _tls_problems(cfg: HostConfig, sources: dict[str, str], cache: _Read,
                  routers: Sequence[str] = ()) -> Iterator[tuple[str, str, str]]:
    """(source, key path, problem) for TLS and the plain HTTP port (its collisions: the port rule of HostConfig);
    ``routers``: the routers group's hosts, whose addresses a certificate names when there is no virtual address."""
    certificate, key = cfg.router_tls_certificate, cfg.router_tls_key
    if (certificate is None) != (key is None):
        given, missing = ("router_tls_certificate", "router_tls_key") if key is None else (
            "router_tls_key", "router_tls_certificate")
        yield sources.get(given, "controller"), missing, f"expected a secret reference with {given}, found null"
        return
    plain = cfg.router_plain_http_port
    if cfg.router_tls_ca is not None and certificate is None:
        yield (sources.get("router_tls_ca", "controller"), "router_tls_ca",
               "expected router_tls_certificate and router_tls_key with it (the CA clients trust for the routers'"
               f" TLS), found {show(cfg.router_tls_ca)} without them")
    elif cfg.router_tls_ca is not None and (problem := ca_problem(cfg.router_tls_ca)):
        yield sources.get("router_tls_ca", "controller"), "router_tls_ca", problem
    if plain is not None and certificate is None:
        yield (sources.get("router_plain_http_port", "controller"), "router_plain_http_port",
               "expected router_tls_certificate and router_tls_key with it (without TLS plain HTTP is on"
               f" router_port), found {plain} without them")
    if certificate is None or key is None:
        return
    pems: list[str] = []
    for name, ref, mark, what in (("router_tls_certificate", certificate, CERTIFICATE_MARK, "a PEM certificate"),
                                  ("router_tls_key", key, PRIVATE_KEY_MARK, "a PEM private key")):
        value = _read(ref, name, cache)
        if isinstance(value, ConfigError):
            yield _unreadable(value, sources.get(name, "controller"), name)
        elif mark not in value:
            yield sources.get(name, "controller"), name, f"expected {what} ({mark.strip('-')}), found none in it"
        else:
            pems.append(value)
    if len(pems) != 2:
        return
    paired = pair_problems(pems[0], pems[1], _named(cfg, routers))
    for name, problem in paired:
        yield sources.get(name, "controller"), name, problem
    ca = cfg.router_tls_ca
    if not paired and ca is not None and ca_problem(ca) is None and (problem := chain_problem(ca, *pems)):
        yield sources.get("router_tls_ca", "controller"), "router_tls_ca", problem


def _named(cfg: HostConfig, routers: Sequence[str]) -> list[str]:
    """The addresses the routers' certificate must name: their virtual address, or each router's (those given as
    IP addresses)."""
    if cfg.router_virtual_address is not None:
        return [cfg.router_virtual_address]
    return [host for host in routers if is_ip_address(host)]


CA_MAX_BYTES = 1 << 20
"""The largest CA file read (a bundle of certificates is kilobytes)."""

PATH_SHOWN = 200
"""The characters of a CA file's path a message shows (a path is no secret: shown whole where it fits)."""


def ca_path(path: str) -> str:
    """A CA file's path as the client is handed it: ``~`` expanded and absolute (the client runs elsewhere)."""
    return str(Path(path).expanduser().absolute())


def ca_problem(path: str) -> str | None:
    """Why the file at ``path`` is not CA certificates a client can trust (no secret: the path may be shown, never
    what the file holds): not a regular readable file, larger than :data:`CA_MAX_BYTES`, holding a private key, or
    not PEM certificates Python's TLS loads."""
    file, shown = Path(path).expanduser(), show(path, PATH_SHOWN)
    try:
        regular = stat.S_ISREG(file.stat().st_mode)
    except (OSError, ValueError):
        regular = False
    if not regular:
        return f"expected a readable PEM certificate file on the controller, found no regular file at {shown}"
    try:
        if file.stat().st_size > CA_MAX_BYTES:
            return f"expected PEM certificates of at most {CA_MAX_BYTES:,} bytes, found a larger file {shown}"
        text = file.read_text(errors="replace")
    except OSError as exc:
        return f"expected a readable PEM certificate file on the controller, found {shown} unreadable" \
               f" ({exc.strerror})"
    if PRIVATE_KEY_MARK in text:
        return f"expected certificates only, found a private key in {shown} (not shown; clients need no key)"
    if CERTIFICATE_MARK not in text:
        return f"expected a PEM certificate ({CERTIFICATE_MARK.strip('-')}), found none in {shown}"
    try:
        ssl.create_default_context(cafile=str(file))
    except (ssl.SSLError, ValueError) as exc:
        return f"expected PEM certificates TLS can load, found {shown} refused ({exc.__class__.__name__})"
    return None


def chain_problem(ca: str, certificate_pem: str, key_pem: str) -> str | None:
    """Why a client trusting the CA file ``ca`` refuses a server that presents ``certificate_pem`` with
    ``key_pem`` (a TLS handshake between the two in memory; names are not compared: clients reach the routers by
    address or name), or None. The key goes to a 0600 file in a private temporary directory, removed after."""
    client = ssl.create_default_context(cafile=ca_path(ca))
    client.check_hostname = False
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory(prefix="gpufleet-tls-") as folder:
        pem = Path(folder) / "server.pem"
        pem.touch(mode=0o600)
        pem.write_text(f"{certificate_pem}\n{key_pem}\n")
        try:
            server.load_cert_chain(str(pem))
        except (ssl.SSLError, ValueError):
            return None  # the pair itself is the certificate's and key's problem, told with them
    pipes = [ssl.MemoryBIO() for _ in range(4)]
    ends = (client.wrap_bio(pipes[0], pipes[1]), server.wrap_bio(pipes[2], pipes[3], server_side=True))
    for _ in range(20):
        done = 0
        for end in ends:
            try:
                end.do_handshake()
                done += 1
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                pass
            except ssl.SSLError as exc:
                return f"expected the CA router_tls_certificate chains to, found one a client refuses it with" \
                       f" ({exc.reason or exc.__class__.__name__})"
        if pipes[1].pending:
            pipes[2].write(pipes[1].read())
        if pipes[3].pending:
            pipes[0].write(pipes[3].read())
        if done == 2:
            return None
    return None


def _served_models(configs: dict[str, HostConfig], serving: list[str]) -> set[str]:
    """Every name a client may ask for: the served models, and their LoRA adapters."""
    return {name for host in serving if host in configs
            for name in (configs[host].served_model_name(), *configs[host].vllm_lora_adapters)}


def edge_problems(hosts: dict[str, HostLayers], serving: list[str], configs: dict[str, HostConfig],
                  override: dict[str, Any] | None = None, routers: list[str] | None = None,
                  inventory: str = "controller") -> list[Problem]:
    """Every host's edge problems (each host's layers, ``serving``: the hosts of serving pools, ``routers``: those
    of the routers group, which must agree on the CA clients trust); each secret is read once, and none is
    shown."""
    routers = routers or []
    served = _served_models(configs, serving)
    cache: _Read = {}
    problems: list[Problem] = []
    for host, config in configs.items():
        if not config.router_clients and config.router_tls_certificate is None and config.router_tls_key is None \
                and config.router_plain_http_port is None and config.router_tls_ca is None:
            continue
        layers = hosts[host].layers + ([Layer("--data", override)] if override else [])
        sources = HostLayers(host, layers).merged()[1]
        found = list(_tls_problems(config, sources, cache, routers)) + list(_client_problems(config, sources, cache))
        for name, client in config.router_clients.items():
            for i, model in enumerate(client.models or []):
                if model not in served:
                    found.append((sources.get("router_clients", "controller"), f"router_clients.{name}.models[{i}]",
                                  f"expected a model a pool serves ({', '.join(map(show, sorted(served)))}),"
                                  f" found {show(model)}"))
        problems += [Problem(source, key, message, (host,)) for source, key, message in found]
    problems += router_wide_problems(hosts, configs, routers, override)
    problems += pool_read_problems(hosts, configs, routers, serving, override)
    problems += address_problems(configs, routers, serving, lambda host, key: _source(hosts, override, host, key,
                                                                                       inventory))
    problems += _past_the_client_keys(hosts, serving, configs, routers, override, cache)
    return problems


def _source(hosts: dict[str, HostLayers], override: dict[str, Any] | None, host: str, key: str,
            unset: str | None = None) -> str:
    """The file that set ``key`` for ``host`` (``--data`` last; "controller" for none); ``unset``, when given, for
    a value no file of the project set (a role's default)."""
    layers = hosts[host].layers + ([Layer("--data", override)] if override else [])
    found = HostLayers(host, layers).merged()[1].get(key, "controller")
    return unset if unset is not None and is_role_default(found) else found


def _past_the_client_keys(hosts: dict[str, HostLayers], serving: list[str], configs: dict[str, HostConfig],
                          routers: list[str], override: dict[str, Any] | None, cache: _Read) -> list[Problem]:
    """With client keys on the routers: a serving host without the replicas' key, a client whose key is a replicas'
    key, a serving host that lets a wide network reach its replicas past the routers."""
    edge = [r for r in routers if r in configs and configs[r].router_clients]
    if not edge:
        return []

    def source(host: str, key: str) -> str:
        return _source(hosts, override, host, key)

    problems: list[Problem] = []
    keyless = [h for h in serving if h in configs and configs[h].vllm_api_key is None]
    if keyless:
        problems.append(Problem(source(keyless[0], "vllm_api_key"), "vllm_api_key",
                                "expected the replicas' own key with router_clients (the routers pass requests on"
                                " with it; a replica without one answers whoever reaches it), found null",
                                tuple(keyless)))
    replica_keys: dict[str, str] = {}
    keys_of: dict[str, dict[str, list[str]]] = {}  # by served model: its replicas' keys, each with its hosts
    for host in serving:
        ref = configs[host].vllm_api_key if host in configs else None
        value = _read(ref, "vllm_api_key", cache) if ref is not None else None
        if isinstance(value, str):
            replica_keys.setdefault(value.strip(), configs[host].served_model_name())
            keys_of.setdefault(configs[host].served_model_name(), {}).setdefault(value.strip(), []).append(host)
    for served_model, keys in keys_of.items():
        if len(keys) > 1:
            named = tuple(host for members in keys.values() for host in members)
            problems.append(Problem(source(named[0], "vllm_api_key"), "vllm_api_key",
                                    f"expected one key for every replica of {show(served_model)} with router_clients"
                                    f" (the routers pass its requests on with one), found {len(keys)}", named))
    in_clear = {value.strip(): (host, name) for host, cfg in configs.items() for name, value in cfg.vllm_env.items()}
    router = configs[edge[0]]
    for name, client in router.router_clients.items():
        value = _read(client.api_key, f"router_clients.{name}.api_key", cache)
        if isinstance(value, str) and (model := replica_keys.get(value.strip())) is not None:
            problems.append(Problem(source(edge[0], "router_clients"), f"router_clients.{name}.api_key",
                                    f"expected a key other than the replicas' (vllm_api_key of {show(model)}: the"
                                    " routers keep it in clear, in their upstream map), found the same (not shown)",
                                    tuple(edge)))
        elif isinstance(value, str) and (where := in_clear.get(value.strip())) is not None:
            problems.append(Problem(source(edge[0], "router_clients"), f"router_clients.{name}.api_key",
                                    f"expected a key no setting holds in clear, found the value of vllm_env.{where[1]}"
                                    f" on {where[0]} (not shown; it is written to that host's unit files)",
                                    tuple(edge)))
    for host in serving:
        allowed = configs[host].vllm_api_allowed_from if host in configs else None
        if allowed and (wide := wide_networks(allowed)):
            problems.append(Problem(source(host, "vllm_api_allowed_from"), "vllm_api_allowed_from",
                                    "expected a site's hosts beside router_clients (IPv4 /16 or narrower, IPv6 /48"
                                    " or narrower: whoever it lets in reaches the replicas past the client keys),"
                                    f" found {', '.join(wide)}", (host,)))
            break
    return problems
