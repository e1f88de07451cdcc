"""Deploy shape (a) of docs/guide/deploy-shapes.md: single-node replicas, 4 x 8xH100, Llama 3.1 70B, TP auto.

inventories/prod.py's ``llama_70b`` pool, with the project's group_vars/all.yml and llama_70b.yml.
"""

from gpufleet.inventory.load import apply_group_vars

llama_70b = [
    ("gpu-a01.dc1.example.net", {"fleet_address": "10.40.0.11"}),
    ("gpu-a02.dc1.example.net", {"fleet_address": "10.40.0.12"}),
    ("gpu-a03.dc1.example.net", {"fleet_address": "10.40.0.13"}),
    ("gpu-a04.dc1.example.net", {"fleet_address": "10.40.0.14"}),
]
apply_group_vars(globals())
