"""The local lab fleet: every node of the running lab (``gpufleet lab up``), read from its state file.

Hosts are the nodes' addresses on the lab bridge, reached as root with the lab's key and checked against
the host keys the lab generated (``<lab dir>/ssh/known_hosts``). Each node's hardware profile is its
``gpu_profile``: the simulated NVML on the node answers from the same profile.

Groups: ``lab`` (every node; ``inventories/lab/group_vars/lab.yml``), then the serving pools, whose values win:
``lab_single`` serves one replica per node, and with three nodes or more the last two form
``lab_pipeline``, one replica with pipeline parallel 2 across both nodes (vLLM's mp backend). Both pools serve
the tiny model under one name; ``routers`` puts the router (HAProxy) on lab1 and lab2, in front of both replicas,
behind the virtual address .10 of the lab bridge (keepalived), serving HTTPS with the lab's own CA (``<lab
dir>/tls``) to one client, ``lab``, with a key of its own; ``monitoring`` puts Prometheus and Alertmanager on lab1,
scraping every node. A lab of one node has one router and no virtual address.
``GPUFLEET_LAB_LAYOUT`` picks another layout of the same nodes (three or more):
``dedicated``: lab1 serves no model: there is no ``lab_single``, and lab1 is a dedicated router and monitoring
host beside the pipeline pair, in no group but ``routers`` and ``monitoring`` (any other group would be its serving
pool): it takes ``group_vars/lab.yml``'s values as its host data, less the model, and has no model to push.
``singles``: no pipeline pair: every node serves one replica of its own (``lab_single``), replicas of one shape
routed by ``router_policy: prefix`` (what bench/prefix_routing.py compares routing policies on).
Values that depend on the running lab (its mirror's address and signing key, its cache, its API key, client key,
hub token (a stand-in), Ray token, VRRP password and CA, its bridge address as the monitoring host and API client)
are host data.
``GPUFLEET_LAB_DIR`` selects a lab other than the default one.
"""

import ipaddress
import os
import sys
from pathlib import Path

import yaml
from gpufleet_lab.errors import LabError
from gpufleet_lab.hooks import mirror_base_url
from gpufleet_lab.mirror import MirrorUrls, adapter_sources, keyring_fingerprint, node_exporter_sources
from gpufleet_lab.network import virtual_address
from gpufleet_lab.nodes import (
    API_KEY_FILE,
    BENCH_KEY_FILE,
    CLIENT_KEY_FILE,
    DAILY_KEY_FILE,
    DAILY_TOKENS_PER_DAY,
    HUB_TOKEN_FILE,
    METERED_KEY_FILE,
    METERED_TOKENS_PER_MINUTE,
    RAY_TOKEN_FILE,
    TLS_DIR,
    VRRP_PASSWORD_FILE,
    ensure_api_key,
)
from gpufleet_lab.state import cache_dir, lab_dir, load_state
from gpufleet_lab.tls import ensure_lab_tls

from gpufleet.config.layers import display_path
from gpufleet.inventory.load import apply_group_vars

_HERE = display_path(Path(__file__))  # as a message names this file, wherever its directory was copied

try:
    _state = load_state()
except LabError as _error:
    sys.exit(f"{_HERE}: {_error}")
if _state is None or not _state.nodes:
    sys.exit(f"{_HERE}: no lab is up in {lab_dir()}; run `gpufleet lab up` first")

_mirror = mirror_base_url(_state.bridge_address)
# the key the mirror signs with (None before the mirror is built: NVIDIA's default then stops every node)
_mirror_key = {"nvidia_repo_key_fingerprint": _key} if (_key := keyring_fingerprint()) else {}
_ray_token = ensure_api_key(lab_dir(), RAY_TOKEN_FILE)  # a lab made before Ray tokens gets one here
_model = str(cache_dir() / "models" / "tiny-llama")
_LAYOUTS = ("default", "dedicated", "singles")
_layout = os.environ.get("GPUFLEET_LAB_LAYOUT") or "default"
if _layout not in _LAYOUTS:
    sys.exit(f"{_HERE}: GPUFLEET_LAB_LAYOUT: expected one of {', '.join(_LAYOUTS)},"
             f" found {_layout!r}")
if _layout != "default" and len(_state.nodes) < 3:
    sys.exit(f"{_HERE}: GPUFLEET_LAB_LAYOUT: expected a lab of three nodes or more for {_layout},"
             f" found {len(_state.nodes)}")
_dedicated = _layout == "dedicated"  # lab1 serves nothing


def _lab_values_less_the_model() -> dict[str, object]:
    """group_vars/lab.yml's values (beside this file) without ``vllm_model``: a dedicated lab1's own (it is in no
    group lab.yml is for)."""
    values = yaml.safe_load((Path(__file__).resolve().parent / "group_vars" / "lab.yml").read_text())
    values.pop("vllm_model")
    return dict(values)

_routers = [node.address for node in _state.nodes[:2]]  # HAProxy on lab1 and lab2
_vip = str(virtual_address(ipaddress.ip_network(_state.subnet))) if len(_routers) >= 2 else None
try:
    _tls = ensure_lab_tls(lab_dir() / TLS_DIR, [*([_vip] if _vip else []), *_routers])
except LabError as _error:
    sys.exit(f"{_HERE}: {_error}")
_edge = {
    # TLS on router_port with the lab CA's certificate; one client, with its own key (the replicas' key stays
    # between the routers and the replicas)
    "router_tls_certificate": {"file": str(_tls.certificate)},
    "router_tls_key": {"file": str(_tls.key)},
    "router_tls_ca": str(_tls.ca_certificate),  # what the bench trusts for the routers
    "router_clients": {"lab": {"api_key": {"file": str(ensure_api_key(lab_dir(), CLIENT_KEY_FILE))},
                               # limits far above what the tests send (the route matrix: ~40 requests in a second)
                               "requests_per_s": 200, "concurrent_requests": 32},
                       # gpufleet bench's: a client limited below a ramp would have its 429s measured as the ceiling
                       "bench": {"api_key": {"file": str(ensure_api_key(lab_dir(), BENCH_KEY_FILE))}},
                       # metered by the routers' token ledger: its served models report streamed usage too
                       "metered": {"api_key": {"file": str(ensure_api_key(lab_dir(), METERED_KEY_FILE))},
                                   "tokens_per_minute": METERED_TOKENS_PER_MINUTE},
                       "daily": {"api_key": {"file": str(ensure_api_key(lab_dir(), DAILY_KEY_FILE))},
                                 "tokens_per_day": DAILY_TOKENS_PER_DAY}},
}
if _layout == "singles":  # three replicas of one shape, routed by their prompts' prefixes
    _edge["router_policy"] = "prefix"
if _vip:  # the routers' virtual address on the bridge, moved between them by keepalived
    _edge["router_virtual_address"] = _vip
    _edge["router_vrrp_password"] = {"file": str(ensure_api_key(lab_dir(), VRRP_PASSWORD_FILE, nbytes=6))}
_hosts = [
    (
        node.address,
        {
            "ssh_user": "root",
            "ssh_key": _state.ssh_key,
            "ssh_known_hosts_file": _state.known_hosts,
            "ssh_strict_host_key_checking": "yes",
            "ssh_look_for_keys": False,
            "ssh_allow_agent": False,
            "gpu_profile": node.profile,
            # NVIDIA's repository: the mirror's signed repository of lab doubles, and the key it is signed with
            "nvidia_repo_url": _mirror + "apt/",
            "nvidia_repo_keyring_url": _mirror + "keys/gpufleet-lab.gpg",
            **_mirror_key,
            # the lab's mirror stands in for a site's wheelhouse: one lock per vLLM release it holds
            # (wheels/requirements-{version}.lock), {version} filled with the host's vllm_version
            "vllm_wheelhouse_url": _mirror + "wheels/",
            "vllm_requirements_url": MirrorUrls(_mirror).wheel_lock("{version}"),
            # the tiny model the mirror built: planned from here, pushed from here (a dedicated lab1 has none)
            **({"vllm_model_config": _model, "vllm_model_source": _model}
               if not (_dedicated and node is _state.nodes[0]) else _lab_values_less_the_model()),
            "vllm_api_key": {"file": str(lab_dir() / API_KEY_FILE)},
            "ray_auth_token": {"file": str(_ray_token)},
            # a stand-in hub token: the model is pushed, so nothing downloads with it (every secret set)
            "vllm_hf_token": {"file": str(ensure_api_key(lab_dir(), HUB_TOKEN_FILE))},
            # the controller's side of the lab (the bridge) scrapes the exporters and calls the APIs, as do the
            # monitoring group's hosts (lab1); any other address, a lab node outside a replica included, is
            # refused by the units' IP filters
            "monitoring_addresses": [_state.bridge_address],
            "vllm_api_allowed_from": [_state.bridge_address],
            # node_exporter from the mirror: its release-layout tarball (sha256 read from the mirror's
            # sha256sums.txt) and, for node_exporter_install=package, its repository of Debian's package
            **node_exporter_sources(_mirror),
            **_edge,
        },
    )
    for node in _state.nodes
]

_serving = _hosts[1:] if _dedicated else _hosts  # the hosts of the lab's serving pools
lab = [address for address, _ in _serving]
routers = _routers  # HAProxy on lab1 and lab2, in front of every replica (a role group, not a serving pool)
# Prometheus and Alertmanager on lab1 (a role group, not a serving pool); a dedicated lab1's data comes with it here
monitoring = [_hosts[0] if _dedicated else _hosts[0][0]]
_pipeline = _hosts[-2:] if len(_hosts) >= 3 and _layout != "singles" else []
_single = [h for h in _serving if h not in _pipeline]
if _single:
    lab_single = _single
    # the tiny model's LoRA adapters the mirror made, pinned by their digests, on the single-node pool only: with
    # LoRA on, vLLM's CPU build turns its graph compilation off and with it the warm-up run that gives a pipeline
    # rank after the first its buffers (the rank fails its first step), so the pipeline pool serves none
    # (GPUFLEET_LAB_ADAPTERS=tiny-critic declares the one more the mirror made: tests/lab/test_adapters.py adds it)
    for _address, _data in _single:
        _data.update(adapter_sources(os.environ.get("GPUFLEET_LAB_ADAPTERS", "")))
if _pipeline:
    lab_pipeline = _pipeline

apply_group_vars(globals())
