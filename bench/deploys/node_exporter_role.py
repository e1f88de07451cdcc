"""The node_exporter role alone (bench/node_exporter_role.py times it against bench/deploys/node_exporter_plain.py)."""

from roles.node_exporter import node_exporter

node_exporter()
