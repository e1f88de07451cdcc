"""The routers' settings: HAProxy in front of the replicas, and the edge (client keys, limits, TLS).

Each field is one variable's record (:mod:`gpufleet.config.settings`); ``roles/router/defaults.yml`` is written
from them.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from gpufleet.config.settings import RoleSettings, setting
from gpufleet.values import grammar, limits
from gpufleet.values.problems import HIDDEN_KEY, KeyedError
from gpufleet.values.types import OptionalSecret, Port, SecretRef, each, secret_ref, served_name, text

# --- the router's edge: client keys and TLS (checked across the fleet, secrets read: gpufleet.config.edge) ---

MIN_KEY_CHARS = 16
"""The shortest client key: a key is all that stands between a client and the fleet's GPUs."""

CLIENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
"""A client's name: a HAProxy map key and stick-table key (no blank, at most 63 bytes) and a Prometheus label."""


def _client_names(value: Any) -> Any:
    """Client names: 1-63 of letters, digits, ``_``, ``.``, ``-``, starting with a letter or digit."""
    if isinstance(value, dict):
        for name in value:
            if isinstance(name, str) and (grammar.secret_like(name) or grammar.random_looking(name)):
                raise KeyedError(HIDDEN_KEY, "expected a client name (a label of its metrics, shown in messages),"
                                             " found a name that looks like a credential (not shown)")
            if not isinstance(name, str) or not CLIENT_NAME.match(name):
                if len(str(name)) >= MIN_KEY_CHARS:  # as long as a key: it may be one, pasted as the name
                    raise KeyedError(HIDDEN_KEY, f"expected a client name (1-63 of letters, digits, '_', '.', '-',"
                                                 f" starting with a letter or digit), found {len(str(name))}"
                                                 " characters that are not one (not shown: it may be a key)")
                raise KeyedError(str(name), "expected a client name (1-63 of letters, digits, '_', '.', '-', starting"
                                            f" with a letter or digit), found {grammar.show(name)}")
    return value


def _client_models(value: Any) -> Any:
    """A client's ``models`` given is a list of one model or more: every served model is ``models`` left out, never
    a key left empty (``models:`` alone reads as null) or an empty list (a client that could use nothing)."""
    if value is None or value == []:
        found = "models: with nothing after it (null)" if value is None else "an empty list"
        raise ValueError(f"expected a list of the served models the client may use (leave models out for every"
                         f" served model), found {found}")
    return value


MAX_TOKEN_BUDGET = 10**12  # tokens a minute or a day: far above any fleet's, below a float's exact integers

PRIORITY_CLASSES: dict[str, int] = {"interactive": 0, "standard": 1, "batch": 2}
"""A client's priority class -> the priority vLLM schedules its requests by (lower first; vLLM's own default is 0)."""
DEFAULT_PRIORITY_CLASS = "standard"  # a client without a class


class TokenWeights(BaseModel):
    """What one prompt token and one completion token count against a token budget."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    prompt: Annotated[float, Field(gt=0, le=1000, allow_inf_nan=False)] = 1.0
    completion: Annotated[float, Field(gt=0, le=1000, allow_inf_nan=False)] = 1.0


class RouterClient(BaseModel):
    """One client of the routers: its key, the served models it may use, its limits (None: no limit), its priority
    class (None: standard)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    api_key: SecretRef
    models: Annotated[list[str], BeforeValidator(each(served_name))] | None = None  # None: every served model
    requests_per_s: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    concurrent_requests: Annotated[int, Field(ge=1, le=100_000)] | None = None
    priority: Literal["interactive", "standard", "batch"] | None = None
    tokens_per_minute: Annotated[int, Field(ge=1, le=MAX_TOKEN_BUDGET)] | None = None
    tokens_per_day: Annotated[int, Field(ge=1, le=MAX_TOKEN_BUDGET)] | None = None
    share: Annotated[int, Field(ge=1, le=1000)] | None = None

    @property
    def metered(self) -> bool:
        """Whether the client has a token budget (the routers' token ledger admits its requests)."""
        return self.tokens_per_minute is not None or self.tokens_per_day is not None

    _check_secret = field_validator("api_key", mode="before")(secret_ref)
    _check_models = field_validator("models", mode="before")(_client_models)

    @field_validator("tokens_per_day")
    @classmethod
    def _day_holds_a_minute(cls, day: int | None, info: ValidationInfo) -> int | None:
        """A day's budget of less than a minute's makes the minute's a promise the day breaks."""
        minute = info.data.get("tokens_per_minute")
        if day is not None and minute is not None and day < minute:
            raise ValueError(f"expected at least tokens_per_minute ({minute}), found {day}")
        return day

class RouterSettings(RoleSettings):
    """The router: HAProxy (the distribution's package) on the hosts of the inventory group `routers`, in front of
    every replica of the plan. Clients send OpenAI-style requests to one address; the router picks the backend of
    the request's `model` field (one backend per served model, holding that model's replicas), balances by least
    connections or by prefix (router_policy), checks each replica's /health, and retries a request that failed to
    connect or got an empty answer or a 503 on another replica. Without router_clients the replicas check the API
    key and the router passes it through; with them the router checks the clients' keys (see "The edge" below).
    """

    router_port: Port = setting(
        8080,
        "Port clients send requests to, on router_listen_address: OpenAI-style requests for every served model.",
        scope="routers",
    )

    router_listen_address: text(grammar.ip_address) | None = setting(  # type: ignore[valid-type]
        None,
        "Address the client port listens on; null: the router's fleet address (fleet_address, else the inventory "
        "host name). \"0.0.0.0\" or \"::\" listens on every interface.",
        read_on="routers",
    )

    router_metrics_port: Port = setting(
        8405,
        "Port of HAProxy's Prometheus endpoint (GET /metrics) on the fleet address; reachable from the router "
        "itself and the monitoring hosts only.",
        read_on="routers",
    )

    router_peer_port: Port = setting(
        8406,
        "Port on the fleet address where the routers keep their tables alike (HAProxy's peers: the clients' "
        "counters, the prefix policy's conversations), TLS only, each side showing the routers' own certificate "
        "(drawn by the deploy; anything else is refused before it reaches a table). The same on every router.",
        scope="routers", read_on="routers",
    )

    router_ledger_port: Port = setting(
        8407,
        "Port of the routers' token ledger (clients with tokens_per_minute, tokens_per_day or a share): on loopback "
        "for this router's HAProxy, and on the fleet address for the other routers' ledgers, TLS only with the "
        "routers' own certificate (as router_peer_port). The first router of the group routers that answers decides "
        "budgets for all; every change reaches the others, so a failover finds each client's budget used. The fair "
        "queue of a shared model is each router's own. The same on every router.",
        scope="routers", read_on="routers",
    )

    router_token_weights: TokenWeights = setting(
        {"prompt": 1.0, "completion": 1.0},
        "What a prompt token and a completion token count against a client's token budgets (numbers above 0, at "
        "most 1,000): {prompt: 1, completion: 4} makes an answer's token cost four of a prompt's, as the decode "
        "that makes it costs the GPUs more.",
        scope="routers", read_on="routers",
    )

    router_check_interval_s: Annotated[int, Field(ge=1, le=3600)] = setting(
        2,
        "Seconds between two health checks of a replica by each router (GET /health).",
        read_on="routers",
    )

    router_check_fall: Annotated[int, Field(ge=1, le=100)] = setting(
        2,
        "Failed health checks in a row that take a replica out of the router.",
        read_on="routers",
    )

    router_check_rise: Annotated[int, Field(ge=1, le=100)] = setting(
        2,
        "Passed health checks in a row that put a replica back into the router.",
        read_on="routers",
    )

    router_timeout_s: Annotated[int, Field(ge=1, le=86400)] = setting(
        600,
        "Seconds a client or a replica may stay silent within one request: streamed generations of long outputs "
        "need minutes.",
        read_on="routers",
    )

    router_connect_timeout_s: Annotated[int, Field(ge=1, le=300)] = setting(
        5,
        "Seconds to connect to a replica before the attempt counts as failed (and is retried on another).",
        read_on="routers",
    )

    router_retries: Annotated[int, Field(ge=0, le=10)] = setting(
        3,
        "Further attempts of a request whose replica failed to connect, answered nothing or answered 503, each on "
        "another replica when one is up (HAProxy's retry-on with option redispatch).",
        read_on="routers",
    )

    router_max_request_bytes: Annotated[int, Field(ge=16384, le=64 * 2**20)] = setting(
        262144,
        "Largest request body (bytes) the router accepts: it reads each body whole, to find the model in it and to "
        "be able to retry it. A larger one is refused with 413, with a length or chunked (raise this for prompts "
        "of more than ~50k tokens; HAProxy's buffers grow with it).",
        scope="routers", read_on="routers",
    )

    router_max_connections: Annotated[int, Field(ge=1, le=500_000)] = setting(
        4096,
        "Concurrent client connections the router accepts.",
        read_on="routers",
    )

    router_server_maxconn: Annotated[int, Field(ge=1, le=50_000)] | None = setting(
        None,
        "Admission: the router sends each replica at most its maxconn requests at once; the others wait in the "
        "router's queue of their model's backend (leastconn: the first replica with a free slot takes the next "
        "one), at most router_queue_timeout_s, then get a fast 503 with \"Retry-After: <router_queue_timeout_s, "
        "rounded up>\" instead of waiting for a timeout. Every 503 HAProxy makes itself (the queue, no replica up) "
        "carries it; a replica's own 503 is retried on another replica (router_retries). Requests one replica "
        "takes at once (HAProxy's server maxconn, 1 to 50000), the same on every host of a pool. null: from the "
        "plan (`gpufleet plan` shows it): the sequences at max_model_len its KV cache holds on each data-parallel "
        "rank, at most the sequences vLLM schedules at once (--max-num-seqs, else vLLM's default), times the ranks "
        "(one router server stands for the whole replica: its API server spreads requests over its ranks); where "
        "a bench record of the replica's model and shape found a ceiling (gpufleet bench; of its release, else of the "
        "newest other), the most "
        "requests vLLM ran at once on one replica at that ceiling instead. The "
        "planner reads it from the replica's hosts, as the vllm_* layout variables: set it in a pool's group_vars "
        "for that pool's replicas, in all.yml for every pool. vllm_max_num_queued_reqs follows it.",
        scope="pool", read_on="pools",
    )

    router_typical_request_tokens: Annotated[int, Field(ge=1, le=limits.MAX_TOKENS)] | None = setting(
        None,
        "Admission sized for the pool's typical request: its prompt and answer tokens together (at most "
        "max_model_len). The plan's maxconn then counts the sequences of this length each replica's KV cache holds, "
        "not sequences at max_model_len (a 70B model at 32k holds 13 of those; most requests are far shorter): a "
        "replica takes more requests at once, and one much longer than this may be preempted for lack of cache, "
        "as vLLM does under load. `gpufleet plan` shows which length each replica's maxconn is sized at. null: "
        "max_model_len. router_server_maxconn, where set, wins.",
        scope="pool", read_on="pools",
    )

    router_queue_timeout_s: Annotated[float, Field(gt=0, le=3600)] = setting(
        5,
        "Seconds (a number > 0, fractions allowed, at most 3600) a request waits in the router's queue for a free "
        "replica before it gets 503 with Retry-After.",
        read_on="routers",
    )

    router_policy: Literal["leastconn", "prefix"] = setting(
        "leastconn",
        "How the router picks a model's replica, per serving pool (every pool that serves one model name must "
        "agree):\n"
        "  leastconn: the replica with the fewest requests in flight.\n"
        "  prefix: requests that share a prefix go to the same replica, whose vLLM has that prefix cached (its\n"
        "    next turn of a conversation, or another user of the same system prompt), with the load kept bounded:\n"
        "    no replica takes more than router_prefix_balance times its share of the requests in flight; new\n"
        "    prefixes go round robin. The prefix: a chat's system message and first user message, a completion's\n"
        "    first 256 bytes of prompt (a request without one goes round robin). The planner refuses it for a\n"
        "    model whose pools turn prefix caching off (vllm_extra_args) or set different block-size or\n"
        "    prefix-caching-hash-algo values.",
        scope="pool", model_wide="(the router has one backend per served model)", read_on="pools",
    )

    router_prefix_balance: Annotated[float, Field(gt=1, le=10)] = setting(
        2,
        "The bound of `prefix` (a number above 1, at most 10): how far above its share of the model's requests in "
        "flight a replica may go before the next request of a prefix it holds goes to another. Requests are whole: "
        "with few in flight, 1.25 passes on a turn whenever its replica holds two of four (1 in 5 turns on the "
        "lab's three replicas), where 2 keeps nearly every conversation home; vLLM batches the extra requests.",
        scope="pool", model_wide="(the router has one backend per served model)", read_on="pools",
    )

    router_clients: Annotated[dict[str, RouterClient], BeforeValidator(_client_names)] = setting(
        {},
        "Clients of the routers, by name (1-63 of letters, digits, '_', '.', '-'; the name is a label of their "
        "metrics):\n"
        "  router_clients:\n"
        "    batch-jobs:\n"
        "      api_key: {env: BATCH_JOBS_KEY}      # a secret reference, never the key; one key per client, 16 to\n"
        "                                          # 4,096 visible characters, not a value any vllm_env holds\n"
        "      models: [meta-llama/Llama-3.1-8B]   # served models it may use (left out: every served model;\n"
        "                                          # null or [] is refused, never read as every model)\n"
        "      requests_per_s: 20                  # requests per second (left out: no limit)\n"
        "      concurrent_requests: 8              # requests at once (left out: no limit)\n"
        "      priority: batch                     # interactive, standard or batch (left out: standard)\n"
        "      tokens_per_minute: 200000           # token budgets per model it uses, a sliding minute and a\n"
        "      tokens_per_day: 50000000            # sliding day (left out: no budget); see router_token_weights\n"
        "      share: 3                            # its weight in a model's tokens when clients wait for it\n"
        "With clients, the router checks each request's \"Authorization: Bearer <key>\": none or an unknown key gets "
        "401, a model the client may not use 403, a request over a limit 429 with Retry-After; the replicas get "
        "the request with their own key (vllm_api_key) instead, which clients never need. The router holds only "
        "the SHA-256 of each key, in map files beside its configuration (root:haproxy, 0640); a deploy that adds, "
        "removes or rotates a key rewrites those files and reloads HAProxy (requests in flight finish). Empty: no "
        "check at the router, the replicas' key passed through (vLLM checks it). A model that a client of a "
        "class beside standard may use is served with --scheduling-policy priority: the router sets each of its "
        "requests' X-Vllm-Priority from the client's class (interactive 0, standard 1, batch 2; vLLM serves the lowest "
        "first and may preempt a running request for a lower one); every other model's requests get 0. Either way a "
        "priority the client sent (header or body) is never what vLLM reads. A client with a token budget has each "
        "request's cost (its prompt's bytes, each counted a token at most, and its max_tokens or "
        "max_completion_tokens, else the model's max_model_len, each weighed by router_token_weights) reserved by "
        "the routers' token "
        "ledger before it is admitted and settled from the usage vLLM reports when it ends (its models are served "
        "with --enable-force-include-usage, so streamed answers report it too); a cost the budgets' windows cannot "
        "hold now gets 429 with Retry-After when it will, one above a whole budget 400, and every answer of the "
        "client carries x-ratelimit-remaining-tokens and x-ratelimit-reset-tokens. Where a client that may use a "
        "model has a share (1 to 1000; left out or null: 1), the model's clients share it fairly in tokens: every "
        "client's request to it waits in the router's token ledger until a place among its replicas' maxconn is "
        "free (router_queue_timeout_s at most, then 503 as the router's own queue answers), and the next to go is "
        "the oldest request of the waiting client that was served the fewest weighed tokens over its share "
        "(virtual token counters; one that comes back from idle gets no credit for its absence): backlogged "
        "clients get tokens in proportion to their shares, whatever each request asks for.",
        scope="routers", read_on="routers", secret="tree", section="The edge: client keys and limits, TLS",
        owned_flags=("--scheduling-policy", "--enable-force-include-usage"),
    )

    router_tls_certificate: OptionalSecret = setting(
        None,
        "TLS on router_port: the certificate (PEM, its chain after it), as a secret reference ({file: PATH} or "
        "{env: NAME}) read on the controller; with router_tls_key, both or neither. With them plain HTTP gets no "
        "answer on router_port. A renewed certificate is loaded by the next deploy with a reload. Both are parsed "
        "before any host: the certificate file holds certificates only (no key), the server's first, valid now, "
        "naming in its subjectAltName the routers' virtual address (or, without one, each router's address; a DNS "
        "name there is taken as given).",
        scope="routers", read_on="routers", secret="reference", section="The edge: client keys and limits, TLS",
    )

    router_tls_key: OptionalSecret = setting(
        None,
        "The private key of router_tls_certificate, as a secret reference ({file: PATH} or {env: NAME}) read on "
        "the controller: the certificate's own key alone, unencrypted PEM (PKCS#1, PKCS#8 or SEC1), RSA of 2048 "
        "bits or more or ECDSA on P-256, P-384 or P-521. An SSH key, an encrypted key or a CA's key is refused.",
        scope="routers", read_on="routers", secret="reference", section="The edge: client keys and limits, TLS",
    )

    router_tls_ca: text(grammar.controller_path) | None = setting(  # type: ignore[valid-type]
        None,
        "The CA certificate (PEM, a file on the controller; not a secret) that router_tls_certificate chains to: "
        "what gpufleet's own clients of the routers (gpufleet bench) trust; null: the controller's system CAs. "
        "Only with TLS.",
        scope="routers", read_on="routers", section="The edge: client keys and limits, TLS",
    )

    router_plain_http_port: Port | None = setting(
        None,
        "With TLS, a second client port that serves plain HTTP (e.g. for clients inside the fleet); null: none.",
        scope="routers", read_on="routers", section="The edge: client keys and limits, TLS",
    )
