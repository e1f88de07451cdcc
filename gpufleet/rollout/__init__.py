"""Rolling a change through the fleet behind its routers (``gpufleet upgrade``, ``gpufleet rollback``).

batches: which replicas go out together; release: what a replica runs, as recorded on its nodes; remote: commands
on hosts over pyinfra's connections; router_control: drain, wait, put back, read the routers; node_releases: the
records on a node; replicas: the units to roll; canary: the watch's verdict; runner: the rollout itself; report:
what it did; pyinfra_run: the limited deploy it runs.
"""
