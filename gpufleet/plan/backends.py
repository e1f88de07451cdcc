"""The routers' backends: one per served model, each with the API of every replica that serves it (the first node's).

The router role writes them into HAProxy's configuration; ``gpufleet upgrade``/``rollback`` drain each replica
by its server in its model's backend, and monitoring names the routers' series by model with them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from gpufleet.config.schema import HostConfig
from gpufleet.netaddr import host_port
from gpufleet.plan.planner import Replica

_IDENTIFIER_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")  # what HAProxy's names may not hold
# The POST routes of vLLM's OpenAI API that clients of a model's replicas may use, by the task the model is served
# for (the plan sizes replicas for generation: every served model is a "generate" one). GET /v1/models and
# GET /health are answered by the router; nothing else reaches a replica.
TASK_ROUTES: dict[str, tuple[str, ...]] = {"generate": ("/v1/completions", "/v1/chat/completions")}


@dataclass(frozen=True)
class Backend:
    """One served model and the replicas that serve it."""

    name: str  # HAProxy's backend name
    model: str  # the served model name clients ask for
    servers: tuple[tuple[str, str], ...]  # (replica name, ADDRESS:PORT of its API)
    task: str = "generate"  # which of TASK_ROUTES its clients may use
    policy: Literal["leastconn", "prefix"] = "leastconn"  # router_policy of the pools that serve it (they agree)
    prefix_balance: float | None = None  # with prefix, their router_prefix_balance

    @property
    def routes(self) -> tuple[str, ...]:
        return TASK_ROUTES[self.task]

    @property
    def bound_percent(self) -> int | None:
        """prefix's bound in whole percent, at least 101 (a replica may always hold its share); None with
        leastconn."""
        return None if self.prefix_balance is None else max(101, round(self.prefix_balance * 100))

    @property
    def model_sha256(self) -> str:
        """What the configuration matches a request's model with: any served name, quoted by nothing."""
        return hashlib.sha256(self.model.encode()).hexdigest()

    @property
    def comment(self) -> str:
        """The model name as a comment line may show it (JSON, ASCII only)."""
        return json.dumps(self.model)


def backends(replicas: Iterable[Replica], configs: dict[str, HostConfig]) -> list[Backend]:
    """One backend per served model, in model order, each with its replicas' first nodes' APIs and the routing
    policy of the first replica's first node (every pool of a model has the same: the planner checks it)."""
    by_model: dict[str, list[tuple[str, str]]] = {}
    routing: dict[str, HostConfig] = {}
    for replica in replicas:
        first = replica.roles[0]
        model = configs[first.host].served_model_name()
        routing.setdefault(model, configs[first.host])
        by_model.setdefault(model, []).append((replica.name, host_port(first.address, replica.port)))
    found: list[Backend] = []
    taken: set[str] = set()
    for model in sorted(by_model):
        name = base = "model-" + _IDENTIFIER_UNSAFE.sub("_", model)
        suffix = 2
        while name in taken:
            name, suffix = f"{base}-{suffix}", suffix + 1
        taken.add(name)
        cfg = routing[model]
        found.append(Backend(name, model, tuple(sorted(by_model[model])), policy=cfg.router_policy,
                             prefix_balance=cfg.router_prefix_balance if cfg.router_policy == "prefix" else None))
    return found
