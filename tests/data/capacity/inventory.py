"""One model served by two shapes under one name, as the lab serves it: a one-node replica (TP 8) on each of two nodes
and one pipeline replica (PP 2, mp) over two more; a router and a monitoring host, where the bench records are."""

from gpufleet.inventory.load import apply_group_vars

single = [
    ("gpu-s01.example.net", {"fleet_address": "10.50.0.11"}),
    ("gpu-s02.example.net", {"fleet_address": "10.50.0.12"}),
]
pipeline = [
    ("gpu-p01.example.net", {"fleet_address": "10.50.1.11"}),
    ("gpu-p02.example.net", {"fleet_address": "10.50.1.12"}),
]
routers = [("router-1.example.net", {"fleet_address": "10.50.9.2"})]
monitoring = [("mon-1.example.net", {"fleet_address": "10.50.9.1"})]

apply_group_vars(globals())
