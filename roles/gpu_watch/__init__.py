"""Role ``gpu_watch``: a GPU that fails at run time takes the node's vLLM replicas out of service until it passes.

After it, the node has ``/etc/systemd/system/gpufleet-gpu-watch.service``, a oneshot in which root runs role common's
node tool ``/opt/gpufleet/node/gpu_watch.py`` (sandboxed: NVML's devices, no network), and
``gpufleet-gpu-watch.timer``, which starts it every ``gpu_watch_interval_s`` seconds, enabled and running. The watch
judges the node with the gate of the replicas' units (``nvml_probe.py --gate``, role vllm's policy
``/etc/gpufleet/gpu-health.json``, written before this role runs). While the node fails it, every ``vllm@``
unit that runs is stopped and ``/run/gpufleet/gpu-gate-failed`` (root, 0644) holds the failed rules and the units
stopped; once it passes, the recorded units that are still enabled start again and the file goes. Each run also adds
its sample of every GPU (clock event reasons, PCIe link, NVLinks) to ``/run/gpufleet/gpu-samples.json`` (root,
0644, the last 120): the node watch's trends (role node_lifecycle).

With ``gpu_watch_interval_s: 0`` the timer is stopped, disabled and removed, and so are those files. A changed unit
file reloads systemd and a changed timer restarts the timer; nothing else restarts. Variables:
roles/gpu_watch/defaults.yml.
"""

from __future__ import annotations

from pyinfra.api.deploy import deploy
from pyinfra.operations.util import any_changed

from gpufleet.node_paths import (
    GATE_POLICY,
    GPU_SAMPLES,
    GPU_WATCH_MARKER,
    GPU_WATCH_SERVICE,
    GPU_WATCH_TIMER,
    NODE_ENV,
    NODE_PYTHON,
    NODE_TOOLS_DIR,
    RUN_DIR,
    node_tool,
    unit_path,
)
from gpufleet.operations import files, node, systemd
from gpufleet.plan import access
from gpufleet.run.context import host_config
from gpufleet.templates import render
from gpufleet.units.escape import exec_line

SERVICE_FILE = unit_path(GPU_WATCH_SERVICE)
TIMER_FILE = unit_path(GPU_WATCH_TIMER)
TIMEOUT_S = 300  # the whole run: the probe (60 s at most), then queued stops or starts


def service_values() -> dict[str, object]:
    """What templates/gpu_watch/gpufleet-gpu-watch.service.j2 is rendered with (the same on every node)."""
    # the node's own Python: the probe imports role common's pynvml.py beside it when it has none
    argv = [NODE_PYTHON, node_tool("gpu_watch.py"), "--policy", GATE_POLICY, "--marker", GPU_WATCH_MARKER,
            "--samples", GPU_SAMPLES]
    return {"service": GPU_WATCH_SERVICE, "timer": GPU_WATCH_TIMER, "node_tools": NODE_TOOLS_DIR,
            "marker": GPU_WATCH_MARKER, "node_env": NODE_ENV, "exec_start": exec_line(argv),
            "timeout": TIMEOUT_S, "run_dir": RUN_DIR.removeprefix("/run/"),
            "ip_access": access.unit_lines([])}  # localhost only: it needs no network


def timer_values(interval: int) -> dict[str, object]:
    """What templates/gpu_watch/gpufleet-gpu-watch.timer.j2 is rendered with: ``gpu_watch_interval_s`` (> 0)."""
    return {"service": GPU_WATCH_SERVICE, "interval": interval}


@deploy("GPU health watch")
def gpu_watch() -> None:
    """Converge the watch's service and timer: on every ``gpu_watch_interval_s`` seconds, or off with 0."""
    interval = host_config().gpu_watch_interval_s
    node.observe(name="Read the GPU health watch's units and marker", units=[GPU_WATCH_TIMER],
                 paths=[SERVICE_FILE, TIMER_FILE, GPU_WATCH_MARKER])
    service = files.file(name=f"Write the GPU health watch's unit {SERVICE_FILE}", dest=SERVICE_FILE,
                         content=render("gpu_watch/gpufleet-gpu-watch.service.j2", **service_values()))
    if interval:
        timer = files.file(name=f"Write {TIMER_FILE}: the watch every {interval} s", dest=TIMER_FILE,
                           content=render("gpu_watch/gpufleet-gpu-watch.timer.j2", **timer_values(interval)))
        systemd.daemon_reload(name="Reload systemd: the GPU health watch's units changed",
                              _if=any_changed(service, timer))
        systemd.restart(name=f"Restart {GPU_WATCH_TIMER}: its interval changed", unit=GPU_WATCH_TIMER,
                        _if=timer.did_change)
        systemd.service(name=f"Enable and start {GPU_WATCH_TIMER}", unit=GPU_WATCH_TIMER, running=True, enabled=True)
        return
    systemd.service(name=f"Stop and disable {GPU_WATCH_TIMER} (gpu_watch_interval_s 0)", unit=GPU_WATCH_TIMER,
                    running=False, enabled=False)
    timer = files.absent(name=f"Remove {TIMER_FILE} (gpu_watch_interval_s 0)", path=TIMER_FILE)
    files.absent(name=f"Remove the watch's marker {GPU_WATCH_MARKER}: it is off", path=GPU_WATCH_MARKER)
    files.absent(name=f"Remove the watch's samples {GPU_SAMPLES}: it is off", path=GPU_SAMPLES)
    systemd.daemon_reload(name="Reload systemd: the GPU health watch's units changed", _if=any_changed(service, timer))
