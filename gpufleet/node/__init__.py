"""Code shipped to GPU nodes and run there by ``python3`` with nvidia-ml-py only.

Files here use the standard library and ``pynvml``, never pydantic or other gpufleet modules:
a file needing a sibling loads it by path. ``nvml_probe.py`` prints the node's GPU facts and,
with ``--gate``, judges them with ``health_rules.py``; ``gpu_watch.py`` runs that gate while the node serves.
``router_admin.py`` drains, weighs and brings back replicas through a router node's HAProxy runtime API, and
writes the counters of the edge's clients for node_exporter.
"""
