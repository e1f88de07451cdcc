"""Priority classes: which served models vLLM schedules by the priority the routers set from each client's class.

A client of the routers may have a class (``router_clients.<name>.priority``; left out, standard). A served model
that a client of another class than standard may use is served with ``--scheduling-policy priority``, and the
router sets each of its requests' ``X-Vllm-Priority`` header from the client's class (:data:`PRIORITY_CLASSES`).
Every other model's requests get priority 0, what a first-come-first-served vLLM expects (0.31 and 0.32 ignore
any other there; their API documents a refusal). vLLM reads the header before the body's ``priority`` field, and
the router replaces any header the client sent, so a client never chooses its own priority.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpufleet.config.schema import HostConfig
from gpufleet.config.settings.router import DEFAULT_PRIORITY_CLASS, PRIORITY_CLASSES, RouterClient

__all__ = ["DEFAULT_PRIORITY", "PRIORITY_CLASSES", "PRIORITY_HEADER", "SCHEDULING_FLAG", "client_priority",
           "schedules_by_priority"]

PRIORITY_HEADER = "X-Vllm-Priority"  # what vLLM 0.31 and later read a request's priority from first
SCHEDULING_FLAG = "--scheduling-policy"
DEFAULT_PRIORITY = PRIORITY_CLASSES[DEFAULT_PRIORITY_CLASS]


def client_priority(client: RouterClient) -> int:
    """The priority vLLM schedules ``client``'s requests by."""
    return PRIORITY_CLASSES[client.priority or DEFAULT_PRIORITY_CLASS]


def schedules_by_priority(model: str, configs: Iterable[HostConfig]) -> bool:
    """Whether the served ``model`` is scheduled by priority: a client of the routers (every router has the same,
    and only routers have clients) of another class than standard may use it (standard written or left out is
    one class, and clients of one class alone have nothing to be scheduled by)."""
    clients = next((cfg.router_clients for cfg in configs if cfg.router_clients), {})
    return any(client_priority(client) != DEFAULT_PRIORITY and (client.models is None or model in client.models)
               for client in clients.values())
