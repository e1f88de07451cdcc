"""Role dcgm_exporter alone, for the lab tests (deploys/monitoring.py runs it among the other exporters)."""

from roles.dcgm_exporter import dcgm_exporter

dcgm_exporter()
