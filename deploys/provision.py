"""Provision GPU nodes: ``pyinfra inventories/prod.py deploys/provision.py``.

Common node setup, then NVIDIA's driver (repository, pinned branch, persistence daemon, fabric manager on
NVSwitch systems, a kernel module that matches) and DCGM's host engine.
"""

from roles.common import common
from roles.dcgm import dcgm
from roles.nvidia_driver import nvidia_driver

common()
nvidia_driver()
dcgm()
