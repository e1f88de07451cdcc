"""TP across nodes: one replica of DeepSeek-V3 at TP 16 over 2 x 8xH100, the ray backend (a Ray cluster of the
two nodes, vLLM on the head)."""

from gpufleet.inventory.load import apply_group_vars

deepseek_tp16 = [
    ("gpu-d01.dc1.example.net", {"fleet_address": "10.40.3.11"}),
    ("gpu-d02.dc1.example.net", {"fleet_address": "10.40.3.12"}),
]
apply_group_vars(globals())
