"""Monitoring's settings: alert thresholds, Prometheus and Alertmanager.

Each field is one variable's record (:mod:`gpufleet.config.settings`); ``roles/monitoring/defaults.yml`` is written
from them.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, field_validator

from gpufleet.config.settings import RoleSettings, setting
from gpufleet.gpu.profiles import ProfileError, parse_profile
from gpufleet.values import grammar, limits
from gpufleet.values.problems import KeyedError
from gpufleet.values.types import Port, each, limit, text

MAX_HOUR_COST = 1_000_000.0  # a GPU hour's cost above this is a typo (cents for units, or a year's price)


def _hour_costs(value: Any) -> Any:
    """gpu_hour_cost: GPU profiles (:mod:`gpufleet.gpu.profiles`) to a number above 0 (``true`` is no number)."""
    if not isinstance(value, dict):
        return value  # pydantic says a mapping was expected
    for key, cost in value.items():
        try:
            parse_profile(str(key))
        except ProfileError as exc:
            if grammar.secret_like(str(key)):
                message = ("expected a GPU profile like 8xH100-SXM as the key, found a key that looks like a"
                           " credential (not shown)")
            elif str(exc).startswith("expected "):
                message = f"{exc} as the key"
            else:  # a GPU or a count that is none
                message = f"expected a GPU profile like 8xH100-SXM as the key, found {grammar.show(str(key))} ({exc})"
            raise KeyedError(str(key), message) from None
        number = isinstance(cost, (int, float)) and not isinstance(cost, bool)
        if not number or not math.isfinite(cost) or not 0 < cost <= MAX_HOUR_COST:
            shown = grammar.show(cost) if isinstance(cost, str) else str(cost).lower() if isinstance(cost, bool) \
                else repr(cost)
            raise KeyedError(str(key), f"expected a number > 0 and at most {MAX_HOUR_COST:,.0f} (one GPU's cost for"
                                       f" an hour), found {shown}")
    return value


STALL_SCRAPES = 4
"""The fewest scrapes a stalled engine's window holds: a token counter that grew between two of them is not a stall."""


class MonitoringSettings(RoleSettings):
    """Role monitoring: Prometheus and Alertmanager on the hosts of the inventory group `monitoring`
    (docs/guide/monitoring.md), and the alert thresholds gpufleet's alert rules (templates/monitoring/rules/) are
    rendered with. The guide's "Alerts" says what each alert means and what to do. Durations are in seconds.
    """

    alert_gpu_critical_xids: list[Annotated[int, Field(ge=1, le=9999)]] = setting(
        [48, 63, 64, 74, 79, 92, 94, 95, 119, 120],
        "XIDs that page: a GPU counted one of these in dcgm-exporter's XID window (DCGM_EXP_XID_ERRORS_COUNT, 5 "
        "min by default). 48 double-bit ECC, 63/64 row remap, 74 NVLink, 79 fallen off the bus, 92 high single-bit "
        "ECC rate, 94/95 contained/uncontained ECC, 119/120 GSP.",
        section="GPU",
    )

    alert_gpu_error_window_s: Annotated[int, Field(ge=60, le=86400)] = setting(
        600,
        "The window over which a GPU's new uncorrectable ECC errors and NVLink errors are counted (seconds).",
        section="GPU",
    )

    alert_gpu_missing_for_s: Annotated[int, Field(ge=0, le=86400)] = setting(
        300,
        "How long a node may report fewer GPUs than its plan's before it alerts (GpuMissing).",
        section="GPU",
    )

    alert_exporter_down_for_s: Annotated[int, Field(ge=0, le=86400)] = setting(
        300,
        "How long a node's dcgm-exporter or node_exporter may not answer before it alerts.",
        section="GPU",
    )

    alert_gpu_nvlink_errors_max: Annotated[int, Field(ge=0), limit(limits.promql_int)] = setting(
        0,
        "NVLink errors (CRC flit and data, replay, recovery; all links of one GPU) tolerated in "
        "alert_gpu_error_window_s.",
        section="GPU",
    )

    alert_gpu_thermal_throttle_ratio: Annotated[float, Field(gt=0, le=1)] = setting(
        0.05,
        "Share of the last 10 minutes (0 to 1) a GPU's clocks may be held down by temperature before it alerts.",
        section="GPU",
    )

    alert_gpu_power_throttle_ratio: Annotated[float, Field(gt=0, le=1)] = setting(
        0.5,
        "Share of the last 10 minutes (0 to 1) a GPU's clocks may be held down by its power limit before it alerts "
        "(busy GPUs touch the limit; this catches a GPU that lives there).",
        section="GPU",
    )

    alert_replica_down_for_s: Annotated[int, Field(ge=0, le=86400)] = setting(
        300,
        "How long a replica's API (its rank 0), one of its ranks, or a model's minimum of ready replicas may be "
        "missing before it alerts: long enough for a restart to load the model.",
        section="Serving",
    )

    alert_engine_stall_s: Annotated[int, Field(ge=STALL_SCRAPES, le=86400)] = setting(
        300,
        "An engine is stalled when requests run or wait and no token came out for this long: at least four "
        "scrapes (prometheus_scrape_interval_s), at most 86400.",
        section="Serving",
    )

    alert_engine_stall_for_s: Annotated[int, Field(ge=0, le=86400)] = setting(
        60,
        "How long a stall must go on being seen, after that window, before it alerts (0 to 86400).",
        section="Serving",
    )

    alert_serving_for_s: Annotated[int, Field(ge=0, le=86400)] = setting(
        300,
        "How long a serving objective (queue, KV cache, time to first token, inter-token latency, error ratio) may "
        "be missed before it alerts. The latency objectives themselves are each pool's vllm_slo_ttft_p99_s and "
        "vllm_slo_itl_p99_s (roles/vllm/defaults.yml).",
        section="Serving",
    )

    alert_queue_waiting_max: Annotated[int, Field(ge=1, le=1_000_000)] = setting(
        100,
        "Requests waiting in one replica's queue above which it alerts.",
        section="Serving",
    )

    alert_kv_cache_usage_max: Annotated[float, Field(gt=0, lt=1)] = setting(
        0.9,
        "KV cache usage (0 to 1) above which a replica alerts, when it also preempts requests.",
        section="Serving",
    )

    alert_error_ratio_max: Annotated[float, Field(gt=0, lt=1)] = setting(
        0.05,
        "Share of a model's requests (0 to 1) the routers may answer with 5xx over 5 minutes.",
        section="Serving",
    )

    alert_capacity_ratio: Annotated[float, Field(gt=0, le=10)] = setting(
        0.8,
        "A model whose request rate through the routers (over 1 minute) stays above this fraction of its measured "
        "ceiling for alert_capacity_for_s alerts (ModelNearItsCeiling): add replicas before the objective is "
        "missed. The ceiling is the model's capacity now (gpufleet:model_ceiling_rps): each replica in service "
        "(ready and UP on the routers) at the highest rate one replica of its shape served within vllm_slo_* "
        "(gpufleet bench), so a replica drained or lost lowers it. Above 0, at most 10. A model never benched has "
        "no ceiling and no such alert.",
        section="Serving",
    )

    alert_capacity_for_s: Annotated[int, Field(ge=0, le=86400)] = setting(
        600,
        "How long a model's request rate must stay above alert_capacity_ratio of its ceiling before "
        "ModelNearItsCeiling alerts (seconds, 0 to 86400).",
        section="Serving",
    )

    alert_prefix_hit_ratio_drop: Annotated[float, Field(gt=0, lt=1)] = setting(
        0.5,
        "A model routed by prefix (router_policy: prefix) alerts (VllmPrefixCacheHitRatioCollapsed) when, for 15 "
        "minutes while its replicas look up prefixes, the share of those tokens found in vLLM's prefix cache stays "
        "below this fraction (above 0, below 1) of its average over the 6 hours before.",
        section="Serving",
    )

    alert_start_time_ratio: Annotated[float, Field(gt=1, le=10)] = setting(
        1.5,
        "A replica whose last start took more than this many times its release's start record on its shape alerts "
        "(ReplicaStartSlow), for an hour after that start: a slow disk, a cold compile cache or a changed CUDA "
        "graph capture shows there first. A start is timed by the deploy's readiness wait, from the unit's main "
        "process start to the first completion; the record is the fastest start of the same model, vLLM release, "
        "layout and GPU profile the deploys have timed (gpufleet_replica_start_record_seconds, kept on the "
        "monitoring hosts). Above 1, at most 10.",
        section="Serving",
    )

    alert_model_disk_free_ratio_min: Annotated[float, Field(gt=0, lt=1)] = setting(
        0.1,
        "Free share (0 to 1) of the filesystem holding /var/lib/gpufleet/models below which it alerts.",
        section="Node",
    )

    alert_unit_restarts_max: Annotated[int, Field(ge=0, le=1000)] = setting(
        3,
        "Automatic restarts of one gpufleet unit in an hour above which it alerts.",
        section="Node",
    )

    gpu_hour_cost: Annotated[dict[str, float], BeforeValidator(_hour_costs)] = setting(
        {},
        "What one GPU costs an hour, by GPU profile (its gpu_profile: 8xH100-SXM, ...), in any one currency: "
        "{8xH100-SXM: 2.49, 8xL40S-PCIe: 0.86}. Each replica whose nodes declare a profile listed here costs its "
        "GPUs (tensor x pipeline x data parallel) times its profile's (gpufleet:replica_gpu_hour_cost), and each "
        "model's cost of a million tokens, prompt and answer together, at the load it serves "
        "(model:gpu_cost_per_million_tokens:5m) is on the model dashboard. A replica of a profile not listed, or "
        "of probed GPUs only, counts nothing. A price is above 0 and at most 1,000,000 (more is a typo: cents for "
        "units, or a year's price). Read on the monitoring hosts: set it in all.yml.",
        section="The plan's figures",
    )

    alert_model_replicas_min_ratio: Annotated[float, Field(gt=0, le=1)] = setting(
        1.0,
        "Share (0 to 1] of each model's planned replicas that must be ready: gpufleet:model_replicas_min is "
        "ceil(ratio x the model's planned replicas), so 1.0 alerts (ModelReplicasBelowMinimum) when any replica is "
        "missing and 0.5 when half of them are.",
        section="The plan's figures",
    )

    prometheus_port: Port = setting(
        9090,
        "Prometheus (Debian's package) listens on the monitoring host's fleet address (fleet_address, else the "
        "inventory host name), this port. Its API and web UI have no login, so its unit admits only the hosts "
        "below.",
        section="Prometheus and Alertmanager (role monitoring, on the hosts of the inventory group `monitoring`)",
    )

    prometheus_scrape_interval_s: Annotated[int, Field(ge=1, le=15)] = setting(
        15,
        "How often Prometheus scrapes every target and evaluates its rules, in seconds (a scrape gives up after "
        "this or 10 s, whichever is sooner). At most 15: a rollout's latency gate and gpufleet bench wait for the "
        "scrape after a wave or a step, and wait no longer than that.",
        section="Prometheus and Alertmanager (role monitoring, on the hosts of the inventory group `monitoring`)",
    )

    prometheus_retention: text(grammar.retention) = setting(  # type: ignore[valid-type]
        "15d",
        "How long Prometheus keeps its samples: a whole number and one unit h, d, w or y, from 2h to 100y.",
        section="Prometheus and Alertmanager (role monitoring, on the hosts of the inventory group `monitoring`)",
    )

    prometheus_allowed_from: Annotated[list[str], BeforeValidator(each(grammar.ip_network))] | None = setting(
        None,
        "Who may reach Prometheus besides the monitoring hosts and the hosts it scrapes (addresses or CIDR "
        "networks, e.g. your Grafana); null: nobody else. Prometheus's unit filters its traffic both ways "
        "(systemd's IP filter): it reaches the fleet's hosts it scrapes and nothing else, so every host needs an "
        "IP fleet_address.",
        section="Prometheus and Alertmanager (role monitoring, on the hosts of the inventory group `monitoring`)",
    )

    alertmanager_listen_address: text(grammar.ip_address) = setting(  # type: ignore[valid-type]
        "127.0.0.1",
        "The address Alertmanager (Debian's package) listens on; Prometheus sends it its alerts there. It has no "
        "login either: whoever reaches it can silence alerts. Clustering is off (each monitoring host runs its "
        "own). Prometheus reaches it over loopback when the address is 0.0.0.0 or ::. Off loopback, its unit "
        "admits only the monitoring hosts and prometheus_allowed_from, and sends only to the webhook below, which "
        "must then name an IP address.",
        section="Prometheus and Alertmanager (role monitoring, on the hosts of the inventory group `monitoring`)",
    )

    alertmanager_port: Port = setting(
        9093,
        "The port Alertmanager listens on, at alertmanager_listen_address.",
        section="Prometheus and Alertmanager (role monitoring, on the hosts of the inventory group `monitoring`)",
    )

    alertmanager_webhook_url: str | None = setting(
        None,
        "Where Alertmanager sends alerts besides the alert log: a webhook (https://, http:// only with "
        "allow_plain_http), with every firing and resolved alert as JSON (Alertmanager's webhook format). It is "
        "written to the monitoring host's configuration in plain text, so it may not carry a secret. null or \"\": "
        "log only (the alert log below).",
        section="Prometheus and Alertmanager (role monitoring, on the hosts of the inventory group `monitoring`)",
    )

    alertmanager_log_port: Port = setting(
        9097,
        "The alert log, always on: gpufleet-alert-log.service takes Alertmanager's notifications on 127.0.0.1 at "
        "this port and writes each alert, firing and resolved, as one line to the journal (journalctl -u "
        "gpufleet-alert-log).",
        section="Prometheus and Alertmanager (role monitoring, on the hosts of the inventory group `monitoring`)",
    )

    alertmanager_group_wait_s: Annotated[int, Field(ge=0, le=3600), limit(limits.alertmanager_wait)] = setting(
        30,
        "How long Alertmanager waits before it sends (to the alert log and the webhook) a new group of alerts (the "
        "same alert name, model and node): alerts that come together go together; one that resolves sooner is not "
        "sent (seconds).",
        section="Prometheus and Alertmanager (role monitoring, on the hosts of the inventory group `monitoring`)",
    )

    alertmanager_group_interval_s: Annotated[int, Field(ge=1, le=86400), limit(limits.alertmanager_interval)] = setting(
        300,
        "How often, at most, Alertmanager sends what changed in a group it has already sent (seconds).",
        section="Prometheus and Alertmanager (role monitoring, on the hosts of the inventory group `monitoring`)",
    )

    alertmanager_repeat_interval_s: Annotated[
        int, Field(ge=60, le=604800), limit(limits.alertmanager_interval)] = setting(
        14400,
        "How often Alertmanager sends again a group that is still firing (seconds).",
        section="Prometheus and Alertmanager (role monitoring, on the hosts of the inventory group `monitoring`)",
    )

    @field_validator("alert_gpu_critical_xids")
    @classmethod
    def _xids(cls, value: list[int]) -> list[int]:
        """At least one XID, each once."""
        if not value:
            raise ValueError("expected at least one XID (e.g. [79]), found an empty list")
        if repeated := sorted({x for x in value if value.count(x) > 1}):
            raise ValueError(f"expected each XID once, found {', '.join(map(str, repeated))} more than once")
        return value
