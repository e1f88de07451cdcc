"""Token budgets and fair shares: which served models the routers' token ledger meters or shares
(gpufleet/node/token_ledger.py).

A client of the routers may have token budgets (``router_clients.<name>.tokens_per_minute``, ``tokens_per_day``).
A served model such a client may use is metered: its replicas report the usage of every answer, streamed ones too
(:data:`USAGE_FLAG`), which settles each request's reservation, and its backend asks the ledger before it admits a
metered client's request. A served model that a client with a ``share`` may use is shared: its replicas report
usage too, and every client's request asks the ledger, which lets it go in its turn by the tokens each client was
served over its share.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpufleet.config.schema import HostConfig

USAGE_FLAG = "--enable-force-include-usage"  # vLLM 0.10 and later: a streamed answer's last event carries usage


def meters_tokens(model: str, configs: Iterable[HostConfig]) -> bool:
    """Whether the served ``model`` is metered: a client of the routers (every router has the same, and only
    routers have clients) with a token budget may use it."""
    clients = next((cfg.router_clients for cfg in configs if cfg.router_clients), {})
    return any(client.metered and (client.models is None or model in client.models) for client in clients.values())


def shares_fairly(model: str, configs: Iterable[HostConfig]) -> bool:
    """Whether the served ``model``'s clients share it fairly in tokens: a client with a ``share`` may use it."""
    clients = next((cfg.router_clients for cfg in configs if cfg.router_clients), {})
    return any(client.share is not None and (client.models is None or model in client.models)
               for client in clients.values())
