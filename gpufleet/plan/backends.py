"""The routers' backends: one per served model, each with the API of every replica that serves it (the first node's).

The router role writes them into HAProxy's configuration; ``gpufleet upgrade``/``rollback`` drain each replica
by its server in its model's backend, and monitoring names the routers' series by model with them.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass
from typing import Literal

from gpufleet.plan.planner import FleetPlan

# The POST routes of vLLM's OpenAI API that clients of a model's replicas may use, by the task the model is served
# for (the plan sizes replicas for generation: every served model is a "generate" one). GET /v1/models and
# GET /health are answered by the router; nothing else reaches a replica.
TASK_ROUTES: dict[str, tuple[str, ...]] = {"generate": ("/v1/completions", "/v1/chat/completions")}
SERVER_ID_SPAN = 2**31 - 1  # HAProxy's server ids: positive, at most 2^31 - 1 (a C int)


def name_sha256(name: str) -> str:
    """A model's or adapter's name as the routers' configuration and maps hold it: its SHA-256, in hex."""
    return hashlib.sha256(name.encode()).hexdigest()


@dataclass(frozen=True)
class Backend:
    """One served model and the replicas that serve it."""

    name: str  # HAProxy's backend name (the served model's)
    model: str  # the served model name clients ask for
    servers: tuple[tuple[str, str], ...]  # (replica name, ADDRESS:PORT of its API)
    task: str = "generate"  # which of TASK_ROUTES its clients may use
    policy: Literal["leastconn", "prefix"] = "leastconn"  # router_policy of the pools that serve it (they agree)
    prefix_balance: float | None = None  # with prefix, their router_prefix_balance
    priority: bool = False  # its replicas schedule by the priority the router sets from the client's class
    metered: bool = False  # the token ledger meters its clients with budgets (gpufleet.plan.token_budgets)
    max_model_len: int = 0  # what a metered request without max_tokens reserves
    fair: bool = False  # its clients share it fairly in tokens: every one's requests ask the ledger
    # its LoRA adapters, each with the replicas that serve it (ServedModel.adapters): routed here, to those only
    adapters: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def routes(self) -> tuple[str, ...]:
        return TASK_ROUTES[self.task]

    @property
    def bound_percent(self) -> int | None:
        """prefix's bound in whole percent, at least 101 (a replica may always hold its share); None with
        leastconn."""
        return None if self.prefix_balance is None else max(101, round(self.prefix_balance * 100))

    @property
    def server_ids(self) -> dict[str, int]:
        """HAProxy's id of each replica's server, by replica name: from the name alone (its CRC-32, 1 to 2^31 - 1),
        so that a replica added or removed changes no other replica's id, and the prefix policy's table, which
        stores ids, keeps every other replica's keys. A clash (about one in two billion for a pair) takes the next
        free id, in name order."""
        found: dict[str, int] = {}
        for name, _ in sorted(self.servers):
            server_id = zlib.crc32(name.encode()) % SERVER_ID_SPAN + 1
            while server_id in found.values():
                server_id = server_id % SERVER_ID_SPAN + 1
            found[name] = server_id
        return found

    @property
    def model_sha256(self) -> str:
        """What the configuration matches a request's model with: any served name, quoted by nothing."""
        return name_sha256(self.model)

    @property
    def names(self) -> tuple[str, ...]:
        """What clients may ask it for: the model, then its adapters."""
        return (self.model, *(name for name, _ in self.adapters))

    def adapter_order(self, adapter: str) -> tuple[str, ...]:
        """The replicas that serve ``adapter``, in the order its requests try them (each while within the bound):
        by the SHA-256 of the adapter's and the replica's names (rendezvous hashing), so that the model's adapters
        spread over its replicas and a replica added or removed moves only the adapters it is first for."""
        holders = dict(self.adapters)[adapter]
        return tuple(sorted(holders, key=lambda replica: name_sha256(f"{adapter}/{replica}")))

    @property
    def comment(self) -> str:
        """The model name as a comment line may show it (JSON, ASCII only)."""
        return json.dumps(self.model)


def backends(plan: FleetPlan) -> list[Backend]:
    """One backend per served model of ``plan``, in model order, with the API of every replica that serves it (its
    first node's) and the model's routing."""
    replicas = {replica.name: replica for replica in plan.replicas}
    found: list[Backend] = []
    for model in plan.models.values():
        servers = sorted((name, replicas[name].api_address) for name in model.replicas)
        found.append(Backend(model.backend, model.name, tuple(servers), policy=model.policy,
                             prefix_balance=model.prefix_balance, priority=model.priority, metered=model.metered,
                             max_model_len=model.max_model_len, fair=model.fair, adapters=model.adapters))
    return found
