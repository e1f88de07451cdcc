"""Every path gpufleet uses on a node: the plan, the roles, the operations and the templates read them here.

Root owns everything below ``/etc/gpufleet``, ``/opt`` and ``/var/lib/gpufleet``; the ``vllm`` user owns only
its home, :data:`VLLM_HOME`.
"""

from __future__ import annotations

import ipaddress

SYSTEMD_DIR = "/etc/systemd/system"

# gpufleet's own configuration
CONFIG_DIR = "/etc/gpufleet"
NODE_ENV = f"{CONFIG_DIR}/node.env"  # the node's name and declared hardware profile
GATE_POLICY = f"{CONFIG_DIR}/gpu-health.json"  # the GPU health gate's policy, read by units' ExecStartPre
SECRETS_DIR = f"{CONFIG_DIR}/secrets"  # root 0700: API key, hub token, Ray token, rank secret, pip index credentials
PIP_SECRET = f"{SECRETS_DIR}/pip.env"  # PIP_INDEX_URL with credentials, read by the vLLM install
VLLM_ETC = f"{CONFIG_DIR}/vllm"  # one directory per replica: config.yaml, vllm.env, venv link
RAY_ENV_DIR = f"{CONFIG_DIR}/ray"  # one environment file per Ray replica

# gpufleet's node tools (standard library + pynvml only), copied from gpufleet/node/
NODE_TOOLS_DIR = "/opt/gpufleet/node"
NODE_TOOL_FILES = ("nvml_probe.py", "health_rules.py", "vllm_ready.py", "replica_rank.py", "ray_join_wait.py",
                   "gpu_watch.py", "replica_watchdog.py", "router_admin.py", "alert_log.py", "router_health.py",
                   "node_state.py", "findings.py", "node_watch.py", "burn_in.py", "fabric_check.py",
                   "diag_collect.py", "token_ledger.py", "staged_adapters.py")
NODE_PYTHON = "/usr/bin/python3"  # the node's own Python, which runs the node tools
NODE_PYNVML = f"{NODE_TOOLS_DIR}/pynvml.py"  # the controller's nvidia-ml-py bindings, for a Python without them

# the GPU health watch (role gpu_watch): its timer runs gpu_watch.py, which stops the node's replicas while its GPUs
# fail the gate and starts them again once they pass
GPU_WATCH_SERVICE = "gpufleet-gpu-watch.service"
GPU_WATCH_TIMER = "gpufleet-gpu-watch.timer"
RUN_DIR = "/run/gpufleet"  # the watch's RuntimeDirectory= (gone at reboot)
GPU_WATCH_MARKER = f"{RUN_DIR}/gpu-gate-failed"  # while the node fails: the failed rules and the units stopped
GPU_SAMPLES = f"{RUN_DIR}/gpu-samples.json"  # the GPU watch's last samples: the node watch's trends

# the node lifecycle (role node_lifecycle): the node's record, kept by node_watch.py's unit, which also answers the
# routers' agent checks; the burn-in's floors; what the node looked like each time it left
NODE_WATCH_SERVICE = "gpufleet-node-watch.service"
LIFECYCLE_CONFIG = f"{CONFIG_DIR}/lifecycle.json"  # policy, findings catalog, agent, kernel log, burn-in
BURN_IN_FLOORS = f"{CONFIG_DIR}/burn-in.json"  # every bound of the burn-in (gpufleet.gpu.burn_in_floors)
NODE_STATE_DIR = "/var/lib/gpufleet/node"  # the unit's StateDirectory=
NODE_STATE_FILE = f"{NODE_STATE_DIR}/state.json"  # the node's record (gpufleet.node-state/1)
NODE_STATE_SUMMARY = f"{NODE_STATE_DIR}/summary.json"  # its state and quarantines' count, small: what a deploy reads
NODES_DIR = "/var/lib/gpufleet/nodes"  # on each monitoring host: <host>.json, the fleet's copy of each node's record
EVIDENCE_DIR = f"{NODE_STATE_DIR}/evidence"  # one folder per departure, root 0700
# the burn-in runs as a unit of its own per tier (the GPUs, JIT-compiled kernels), started by the node watch; each run
# writes its verdict (gpufleet.burn-in/1) to BURN_IN_DIR/<tier>.json
BURN_IN_TIERS = ("quick", "full")
BURN_IN_DIR = "/var/lib/gpufleet/burn-in"  # the units' StateDirectory=


def burn_in_service(tier: str) -> str:
    """The unit that runs one tier of the burn-in."""
    return f"gpufleet-burn-in-{tier}.service"

# gpufleet diag's captures, root 0700, the newest kept: on each monitoring host, the archives a rollout took when it
# rolled a replica back (gpufleet.diag.captures); on each node, what it collected of itself when a replica's unit
# ended a restart loop or the node was quarantined (diag_collect.py capture, run by the capture unit)
DIAG_CAPTURES_DIR = "/var/lib/gpufleet/diag"
CAPTURE_UNIT_TEMPLATE = "gpufleet-capture@.service"  # diag_collect.py capture --reason <instance>, root, oneshot
RESTART_LOOP_CAPTURE = "gpufleet-capture@restart-loop-%p-%i.service"  # a replica unit's OnFailure= (specifiers)


def capture_unit(reason: str) -> str:
    """The capture unit taken for ``reason`` (a unit instance name: letters, digits, ``-``, ``_``, ``.``)."""
    return CAPTURE_UNIT_TEMPLATE.replace("@", f"@{reason}")


QUARANTINE_CAPTURE = capture_unit("node-quarantined")  # started by the node watch when it quarantines the node

# the alert log (role monitoring): every alert Alertmanager sends, a line each in its journal (alert_log.py)
ALERT_LOG_SERVICE = "gpufleet-alert-log.service"

# the router (role router): HAProxy's runtime API (level admin) on a router node, which router_admin.py drives
ROUTER_ADMIN_SOCKET = "/run/haproxy/gpufleet-runtime.sock"

# the routers' virtual address (role keepalived): router_health.py's unit keeps HAProxy's health in a file that
# keepalived tracks
ROUTER_HEALTH_SERVICE = "gpufleet-router-health.service"
ROUTER_HEALTH_DIR = "/run/gpufleet-router-health"  # the unit's RuntimeDirectory= (gone when it stops)
ROUTER_HEALTH_STATE = f"{ROUTER_HEALTH_DIR}/healthy"  # 1: HAProxy passes; 0, empty or missing: it does not

# vLLM
VLLM_ROOT = "/opt/vllm"  # one virtualenv per version: /opt/vllm/<version> -> /opt/vllm/.build-<version>-<digest>-*
VLLM_HOME = "/var/lib/vllm"  # the vllm user's home and caches (StateDirectory=vllm): nothing root runs or trusts
PYCACHE_DIR = f"{VLLM_HOME}/pycache"  # bytecode the vllm user's processes compile (PYTHONPYCACHEPREFIX)
VLLM_CACHE_DIR = f"{VLLM_HOME}/vllm-cache"  # vLLM's own caches, one directory per release (VLLM_CACHE_ROOT)
RAY_TEMP_DIR = f"{VLLM_HOME}/ray"  # outside vLLM's PrivateTmp, so vLLM's driver reaches the local raylet
MODELS_DIR = "/var/lib/gpufleet/models"  # root-owned: hub ids are downloaded to <MODELS_DIR>/<org>--<name>
ADAPTERS_DIR = "/var/lib/gpufleet/adapters"  # root:vllm 0750: LoRA adapters by their weights' digest, as declared
VLLM_UNIT_TEMPLATE = "vllm@.service"
WATCHDOG_UNIT_TEMPLATE = "vllm-watchdog@.service"  # on a replica's first node: restarts it when it is wedged
INSTALLED_MARKER = ".gpufleet-installed"  # in a virtualenv: what its install was asked for
# uv, which installs vLLM's virtualenvs: installed by pip from the site's own wheels, one virtualenv per version
UV_ROOT = "/opt/gpufleet/uv"  # <UV_ROOT>/<version> -> <UV_ROOT>/.build-<version>-*, whose bin/uv runs
UV_CACHE_DIR = "/var/cache/gpufleet/uv"  # uv's cache (root); builds hardlink from it where on /opt's filesystem
REVISION_MARKER = ".gpufleet-revision"  # in a downloaded model: the revision it holds

# the systemd units of the services the roles install, by the packages' or gpufleet's own names
DCGM_HOSTENGINE = "nvidia-dcgm.service"  # DCGM's host engine (roles dcgm and dcgm_exporter)
DCGM_EXPORTER_SERVICE = "dcgm-exporter.service"  # role dcgm_exporter
NODE_EXPORTER_UNIT = "node_exporter.service"  # role node_exporter, the release tarball's (gpufleet's own unit)
NODE_EXPORTER_PACKAGE_UNIT = "prometheus-node-exporter.service"  # role node_exporter, the distribution's package
PROMETHEUS_UNIT = "prometheus.service"  # role monitoring, the distribution's package
FABRICMANAGER = "nvidia-fabricmanager"  # role nvidia_driver: the fabric manager's package (versioned) and service
ROUTER_SERVICE = "haproxy.service"  # role router

# exporters
TEXTFILE_DIR = "/var/lib/node_exporter/textfile_collector"  # node_exporter's textfile collector
# on a monitoring host: the start record of each release on each shape (gpufleet.measure.starts), for the alert
START_RECORDS_TEXTFILE = f"{TEXTFILE_DIR}/gpufleet-start-records.prom"
NODE_EXPORTER_CACHE = "/var/cache/gpufleet/node_exporter"  # the checked release tarball, pushed
DCGM_EXPORTER_COUNTERS = "/etc/dcgm-exporter/gpufleet-counters.csv"

# apt
KEYRING_DIR = "/etc/apt/keyrings"

# systemd gives a unit this PATH when it sets none (systemd-path search-binaries-default on Debian 12)
UNIT_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def replica_dir(replica: str) -> str:
    """``/etc/gpufleet/vllm/<replica>``: the replica's config.yaml, vllm.env and venv link."""
    return f"{VLLM_ETC}/{replica}"


def adapter_store(sha256: str) -> str:
    """One LoRA adapter's revision as declared (its ``adapter_config.json`` and weights), by its weights' digest."""
    return f"{ADAPTERS_DIR}/{sha256[:16]}"


def resolver_dir(replica: str) -> str:
    """The adapters ``replica`` serves, one directory per name (vLLM's filesystem resolver reads it)."""
    return f"{replica_dir(replica)}/adapters"


def restart_marker(replica: str) -> str:
    """Present while a restart of ``replica`` that a deploy decided on has not completed."""
    return f"{replica_dir(replica)}/restart-pending"


def release_file(replica: str) -> str:
    """What the replica runs (its release: gpufleet.rollout.release), written by every deploy (root, 0644)."""
    return f"{replica_dir(replica)}/release.json"


def previous_release_file(replica: str) -> str:
    """The release the replica ran before the last change ``gpufleet upgrade``/``rollback`` made: its rollback."""
    return f"{replica_dir(replica)}/release.previous.json"


def observed_file(replica: str) -> str:
    """What vLLM reported of its KV cache at the replica's last start, beside the plan's figure (root, 0644, on its
    first node): written by the readiness wait (``vllm_ready.py --observed``), read by the deploy's report and
    ``gpufleet plan --observed``."""
    return f"{replica_dir(replica)}/observed.json"


def start_textfile(replica: str) -> str:
    """The phases of the replica's last start the deploy waited for, on its first node, for node_exporter's textfile
    collector (root, 0644): written by the readiness wait (``vllm_ready.py --start-textfile``)."""
    return f"{TEXTFILE_DIR}/gpufleet-replica-start-{replica}.prom"


def watchdog_config(replica: str) -> str:
    """What the replica's watchdog reads (root, 0644, no secrets): its unit, API URL, model name and times."""
    return f"{replica_dir(replica)}/watchdog.json"


def replica_host_part(host: str) -> str:
    """A host's part of a replica's name (``<pool>-<part>[-<k>]``): its first DNS label, or its whole address
    with dashes."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host.split(".")[0]
    return host.replace(".", "-").replace(":", "-")


def watchdog_unit(replica: str) -> str:
    """The replica's watchdog on its first node: ``vllm-watchdog@<replica>.service``."""
    return f"vllm-watchdog@{replica}.service"


def watchdog_enabled_link(replica: str) -> str:
    """What enabling the watchdog makes (``WantedBy=vllm@<replica>.service``): the replica's start pulls it in."""
    return f"{SYSTEMD_DIR}/vllm@{replica}.service.wants/{watchdog_unit(replica)}"


def replica_secrets(replica: str) -> str:
    """The replica's API key and hub token as an EnvironmentFile (root 0600)."""
    return f"{SECRETS_DIR}/{replica}.env"


def rank_secret_file(replica: str) -> str:
    """On each node of a multi-node mp replica, its rank secret as an EnvironmentFile (``GPUFLEET_RANK_SECRET=...``,
    root 0600): what its ranks prove to each other (``gpufleet/node/replica_rank.py``)."""
    return f"{SECRETS_DIR}/{replica}.rank.env"


def ray_token_file(replica: str) -> str:
    """The replica's Ray token as an EnvironmentFile (``RAY_AUTH_TOKEN=...``, root 0600)."""
    return f"{SECRETS_DIR}/{replica}.ray.env"


def ray_env_file(replica: str) -> str:
    return f"{RAY_ENV_DIR}/{replica}.env"


RAY_UNIT_PREFIX = "gpufleet-ray-"


def ray_unit(replica: str) -> str:
    """The replica's Ray head or worker unit on a node: ``gpufleet-ray-<replica>.service``."""
    return f"{RAY_UNIT_PREFIX}{replica}.service"


def vllm_ray_drop_in(replica: str) -> str:
    """On a Ray replica's head, what orders ``vllm@<replica>.service`` after its Ray cluster."""
    return f"{SYSTEMD_DIR}/vllm@{replica}.service.d/ray.conf"


def venv_dir(version: str) -> str:
    """One virtualenv per vLLM version, so an upgrade can switch and roll back."""
    return f"{VLLM_ROOT}/{version}"


def cuda_home(cuda_version: str) -> str:
    """``/usr/local/cuda-<major>.<minor>``: where NVIDIA's ``cuda-toolkit-<major>-<minor>`` packages install it."""
    return f"/usr/local/cuda-{cuda_version}"


def venv_bin(version: str, program: str) -> str:
    return f"{venv_dir(version)}/bin/{program}"


def node_tool(name: str) -> str:
    return f"{NODE_TOOLS_DIR}/{name}"


def unit_path(unit: str) -> str:
    return f"{SYSTEMD_DIR}/{unit}"
