"""Converge the monitoring roles on every host: ``pyinfra inventories/lab/inventory.py deploys/monitoring.py``.

The base node (role common), then Prometheus node_exporter (host and systemd metrics, textfile collector),
then NVIDIA's DCGM exporter (GPU metrics; it reads through DCGM's host engine and installs from NVIDIA's
repository, both set up by deploys/provision.py), then, on the hosts of the inventory group ``monitoring``,
Prometheus and Alertmanager (role monitoring), configured from the fleet's plan: the first monitoring host probes
and plans the fleet as deploys/vllm.py does.
"""

from roles.common import common
from roles.dcgm_exporter import dcgm_exporter
from roles.monitoring import monitoring
from roles.node_exporter import node_exporter

common()
node_exporter()
dcgm_exporter()
monitoring()
