"""The lab's ``lab_pipeline`` pool as inventories/lab/inventory.py lists it for the default lab of three nodes: its
last two nodes serve one replica with PP 2 (vLLM's mp backend).

The values that depend on a running lab are fixed here: the bridge 10.213.0.1 and its mirror, the lab
directory's secret files, and the tiny model's config (tests/plans/tiny-llama, as the lab's model has it).
"""

from pathlib import Path

from gpufleet.inventory.load import apply_group_vars

_mirror = "http://10.213.0.1:8080/"
_model = str(Path(__file__).resolve().parent.parent / "tiny-llama")
_hosts = [
    (
        address,
        {
            "gpu_profile": "8xH100-SXM",
            "nvidia_repo_url": _mirror + "apt/",
            "nvidia_repo_keyring_url": _mirror + "keys/gpufleet-lab.gpg",
            "vllm_wheelhouse_url": _mirror + "wheels/",
            "vllm_requirements_url": _mirror + "wheels/requirements-{version}.lock",
            "vllm_model_config": _model,
            "vllm_model_source": _model,
            "vllm_api_key": {"file": "/var/lib/gpufleet-lab/vllm-api-key"},
            "ray_auth_token": {"file": "/var/lib/gpufleet-lab/ray-auth-token"},
            "monitoring_addresses": ["10.213.0.1"],
            "vllm_api_allowed_from": ["10.213.0.1"],
        },
    )
    for address in ["10.213.0.12", "10.213.0.13"]
]

lab = [address for address, _ in _hosts]
lab_pipeline = _hosts

apply_group_vars(globals())
