"""Production fleet (an example to edit): pyinfra inventory with YAML group_vars.

Groups are serving pools: every host of a group serves the same model with the same layout.
Values come from group_vars/all.yml, then group_vars/<group>.yml, then the host data below;
``pyinfra --data key=value`` overrides them all.
"""

from gpufleet.inventory.load import apply_group_vars

# Four 8x H100 SXM servers, each serving Llama 3.1 70B on its own (the planner picks TP and how
# many replicas fit on each node from the NVLink topology).
llama_70b = [
    ("gpu-a01.dc1.example.net", {"fleet_address": "10.40.0.11"}),
    ("gpu-a02.dc1.example.net", {"fleet_address": "10.40.0.12"}),
    ("gpu-a03.dc1.example.net", {"fleet_address": "10.40.0.13"}),
    ("gpu-a04.dc1.example.net", {"fleet_address": "10.40.0.14"}),
]

# Two 8x H100 SXM servers serving DeepSeek-V3 together: TP 8 inside each node, PP 2 across them.
deepseek_v3 = [
    ("gpu-b01.dc1.example.net", {"fleet_address": "10.40.1.11"}),
    ("gpu-b02.dc1.example.net", {"fleet_address": "10.40.1.12"}),
]

apply_group_vars(globals())
