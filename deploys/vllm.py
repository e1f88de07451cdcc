"""Everything, in order: check, provision, monitoring, serve.

    pyinfra inventories/prod.py deploys/vllm.py

The fleet's configuration is validated before any operation runs (bad input: exit 2), and every
host's GPUs are probed once and the fleet planned from them. Every node gets the base setup, the
NVIDIA driver and DCGM; a node whose GPUs then fail its ``gpu_health`` gate (or that the plan cannot
use) stops there and is named in the report. The others get the exporters, vLLM, the Ray units of
Ray replicas, their replicas started and checked with one real completion, and the GPU health watch that
stops them while their GPUs fail at run time (roles/site.py).
"""

from gpufleet.run.context import context
from roles.site import site

context()  # probe, gate and plan the whole fleet once, before any operation is added
site()
