"""Every path gpufleet uses on a node: the plan, the roles, the operations and the templates read them here.

Root owns everything below ``/etc/gpufleet``, ``/opt`` and ``/var/lib/gpufleet``; the ``vllm`` user owns only
its home, :data:`VLLM_HOME`.
"""

from __future__ import annotations

SYSTEMD_DIR = "/etc/systemd/system"

# gpufleet's own configuration
CONFIG_DIR = "/etc/gpufleet"
NODE_ENV = f"{CONFIG_DIR}/node.env"  # the node's name and declared hardware profile
GATE_POLICY = f"{CONFIG_DIR}/gpu-health.json"  # the GPU health gate's policy, read by units' ExecStartPre
SECRETS_DIR = f"{CONFIG_DIR}/secrets"  # root 0700: API key, hub token, Ray token, pip index credentials
PIP_SECRET = f"{SECRETS_DIR}/pip.env"  # PIP_INDEX_URL with credentials, read by the vLLM install
VLLM_ETC = f"{CONFIG_DIR}/vllm"  # one directory per replica: config.yaml, vllm.env, venv link
RAY_ENV_DIR = f"{CONFIG_DIR}/ray"  # one environment file per Ray replica

# gpufleet's node tools (standard library + pynvml only), copied from gpufleet/node/
NODE_TOOLS_DIR = "/opt/gpufleet/node"
NODE_TOOL_FILES = ("nvml_probe.py", "health_rules.py", "vllm_ready.py", "replica_rank.py")
NODE_PYNVML = f"{NODE_TOOLS_DIR}/pynvml.py"  # the controller's nvidia-ml-py bindings, for a Python without them

# vLLM
VLLM_ROOT = "/opt/vllm"  # one virtualenv per version: /opt/vllm/<version> -> /opt/vllm/.build-<version>-<digest>-*
VLLM_HOME = "/var/lib/vllm"  # the vllm user's home and caches (StateDirectory=vllm): nothing root runs or trusts
PYCACHE_DIR = f"{VLLM_HOME}/pycache"  # bytecode the vllm user's processes compile (PYTHONPYCACHEPREFIX)
RAY_TEMP_DIR = f"{VLLM_HOME}/ray"  # outside vLLM's PrivateTmp, so vLLM's driver reaches the local raylet
MODELS_DIR = "/var/lib/gpufleet/models"  # root-owned: hub ids are downloaded to <MODELS_DIR>/<org>--<name>
VLLM_UNIT_TEMPLATE = "vllm@.service"
INSTALLED_MARKER = ".gpufleet-installed"  # in a virtualenv: what its install was asked for
# uv, which installs vLLM's virtualenvs: installed by pip from the site's own wheels, one virtualenv per version
UV_ROOT = "/opt/gpufleet/uv"  # <UV_ROOT>/<version> -> <UV_ROOT>/.build-<version>-*, whose bin/uv runs
UV_CACHE_DIR = "/var/cache/gpufleet/uv"  # uv's cache (root); builds hardlink from it where on /opt's filesystem
REVISION_MARKER = ".gpufleet-revision"  # in a downloaded model: the revision it holds

# exporters
TEXTFILE_DIR = "/var/lib/node_exporter/textfile_collector"  # node_exporter's textfile collector
NODE_EXPORTER_CACHE = "/var/cache/gpufleet/node_exporter"  # the checked release tarball, pushed
DCGM_EXPORTER_COUNTERS = "/etc/dcgm-exporter/gpufleet-counters.csv"

# apt
KEYRING_DIR = "/etc/apt/keyrings"


def replica_dir(replica: str) -> str:
    """``/etc/gpufleet/vllm/<replica>``: the replica's config.yaml, vllm.env and venv link."""
    return f"{VLLM_ETC}/{replica}"


def restart_marker(replica: str) -> str:
    """Present while a restart of ``replica`` that a deploy decided on has not completed."""
    return f"{replica_dir(replica)}/restart-pending"


def replica_secrets(replica: str) -> str:
    """The replica's API key and hub token as an EnvironmentFile (root 0600)."""
    return f"{SECRETS_DIR}/{replica}.env"


def ray_token_file(replica: str) -> str:
    """The replica's Ray token as an EnvironmentFile (``RAY_AUTH_TOKEN=...``, root 0600)."""
    return f"{SECRETS_DIR}/{replica}.ray.env"


def ray_env_file(replica: str) -> str:
    return f"{RAY_ENV_DIR}/{replica}.env"


def venv_dir(version: str) -> str:
    """One virtualenv per vLLM version, so an upgrade can switch and roll back."""
    return f"{VLLM_ROOT}/{version}"


def venv_bin(version: str, program: str) -> str:
    return f"{venv_dir(version)}/bin/{program}"


def node_tool(name: str) -> str:
    return f"{NODE_TOOLS_DIR}/{name}"


def unit_path(unit: str) -> str:
    return f"{SYSTEMD_DIR}/{unit}"
