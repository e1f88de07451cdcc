"""Everything, in order: check, provision, monitoring, serve.

    pyinfra inventories/prod.py deploys/vllm.py

The fleet's configuration is validated before any operation runs (bad input: exit 2), and every
host's GPUs are probed once and the fleet planned from them. Every node gets the base setup, the
NVIDIA driver and DCGM; a node whose GPUs then fail its ``gpu_health`` gate (or that the plan cannot
use) stops there and is named in the report. The others get the exporters, vLLM, the Ray units of
Ray replicas, and their replicas started and checked with one real completion.
"""

from gpufleet.deploy.context import context
from gpufleet.deploy.gate_ops import gpu_gate
from roles.common import common
from roles.dcgm import dcgm
from roles.dcgm_exporter import dcgm_exporter
from roles.node_exporter import node_exporter
from roles.nvidia_driver import nvidia_driver
from roles.ray import ray
from roles.vllm import vllm_install, vllm_serve

context()  # probe, gate and plan the whole fleet once, before any operation is added

common()
nvidia_driver()
dcgm()
gpu_gate(name="GPU health gate")
node_exporter()
dcgm_exporter()
vllm_install()
ray()
vllm_serve()
