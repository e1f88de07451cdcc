"""Converge the monitoring roles on every host: ``pyinfra inventories/lab.py deploys/monitoring.py``.

The base node (role common), then Prometheus node_exporter (host and systemd metrics, textfile collector).
"""

from roles.common import common
from roles.node_exporter import node_exporter

common()
node_exporter()
