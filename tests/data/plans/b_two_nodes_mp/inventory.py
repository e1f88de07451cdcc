"""Deploy shape (b) of docs/guide/deploy-shapes.md: one replica over 2 x 8xH100, Llama 3.1 405B, TP 8 x PP 2,
the mp backend."""

from gpufleet.inventory.load import apply_group_vars

llama_405b = [
    ("gpu-c01.dc1.example.net", {"fleet_address": "10.40.2.11"}),
    ("gpu-c02.dc1.example.net", {"fleet_address": "10.40.2.12"}),
]
apply_group_vars(globals())
