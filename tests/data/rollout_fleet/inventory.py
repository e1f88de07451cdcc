"""A fleet behind two dedicated routers, for ``gpufleet upgrade`` and ``rollback``: three 8xH100 nodes serving
Llama 3.1 70B, two replicas on each node (so each node's two replicas are one unit of the rollout)."""

from gpufleet.inventory.load import apply_group_vars

llama_70b = [
    ("gpu-a01.dc1.example.net", {"fleet_address": "10.40.0.11"}),
    ("gpu-a02.dc1.example.net", {"fleet_address": "10.40.0.12"}),
    ("gpu-a03.dc1.example.net", {"fleet_address": "10.40.0.13"}),
]
routers = [
    ("router1.dc1.example.net", {"fleet_address": "10.40.9.1"}),
    ("router2.dc1.example.net", {"fleet_address": "10.40.9.2"}),
]
apply_group_vars(globals())
