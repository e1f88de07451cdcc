"""A small fleet with every kind of scrape target: single-node replicas (two per node) of a model with a hostile
served name, a multi-node mp replica and a multi-node Ray replica of one model, a dedicated router on IPv6 and a
serving node that routes too, and a dedicated monitoring host."""

from gpufleet.inventory.load import apply_group_vars

chat = [
    ("gpu-a01.example.net", {"fleet_address": "10.40.0.11"}),
    ("gpu-a02.example.net", {"fleet_address": "10.40.0.12", "node_exporter_listen_address": "0.0.0.0"}),
]
pipeline = [
    ("gpu-p01.example.net", {"fleet_address": "10.40.1.11"}),
    ("gpu-p02.example.net", {"fleet_address": "10.40.1.12"}),
]
raypool = [
    ("gpu-r01.example.net", {"fleet_address": "10.40.2.11"}),
    ("gpu-r02.example.net", {"fleet_address": "10.40.2.12"}),
]
routers = [("router-1.example.net", {"fleet_address": "fd00::5"}), "gpu-a01.example.net"]
monitoring = [("mon-1.example.net", {"fleet_address": "10.40.9.1"})]

apply_group_vars(globals())
