"""A fleet one of whose serving nodes is this machine (127.0.0.1): gpufleet bench refuses to run its client there."""

from gpufleet.inventory.load import apply_group_vars

llama_70b = [
    ("gpu-a01.dc1.example.net", {"fleet_address": "127.0.0.1"}),
    ("gpu-a02.dc1.example.net", {"fleet_address": "10.40.0.12"}),
]
apply_group_vars(globals())
