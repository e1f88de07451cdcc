"""The vLLM deploy of some hosts, as a rollout runs it: pyinfra's own command, its output streamed to the operator.

    pyinfra INVENTORY deploys/vllm.py -y --limit NODE [--limit NODE ...] [--data KEY=VALUE ...]

It runs from the project's root, where ``deploys/`` and pyinfra's ``config.py`` are. The operator's ``--data``
come first, as given, then a release's values (:func:`gpufleet.rollout.release.data_items`), which replace an
operator's item of the same key. Each argument is one argv item: no shell reads any of them.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpufleet.rollout.release import Release, data_items

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # gpufleet's checkout: deploys/, roles/, config.py
DEPLOY = "deploys/vllm.py"
STOP_WAIT_S = 30  # how long an interrupted deploy has to stop before it is killed
WAIT_POLL_S = 0.5  # each timed wait on pyinfra (subprocess polls within it every few milliseconds)


def pyinfra_program() -> str | None:
    """pyinfra's command beside this Python (its virtualenv), else on PATH."""
    beside = Path(sys.executable).with_name("pyinfra")
    return str(beside) if beside.is_file() else shutil.which("pyinfra")


@dataclass(frozen=True)
class PyinfraDeploy:
    """:class:`gpufleet.rollout.runner.Deployer` running pyinfra as a child process."""

    program: str
    inventory: Path
    data: tuple[str, ...] = ()  # the operator's --data items, as given
    root: Path = PROJECT_ROOT

    def argv(self, hosts: Sequence[str], release: Release) -> list[str]:
        argv = [self.program, str(self.inventory.resolve()), DEPLOY, "-y"]
        for host in hosts:
            argv += ["--limit", host]
        items = [item for item in self.data if item.partition("=")[0] not in release] + data_items(release)
        for item in items:
            argv += ["--data", item]
        return argv

    def deploy(self, hosts: Sequence[str], data: Release) -> int:
        """Run it and return its exit status. Interrupted, it passes the interrupt on (a SIGTERM to gpufleet
        reaches no child by itself), waits for pyinfra to stop, and raises KeyboardInterrupt again."""
        child = subprocess.Popen(self.argv(hosts, data), cwd=self.root)
        try:
            while True:
                # Timed waits: a signal that reached another thread (paramiko's, say) is raised here within one
                # poll; a plain wait() would block in waitpid until pyinfra ended by itself.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    return child.wait(WAIT_POLL_S)
        except KeyboardInterrupt:
            if child.poll() is None:
                child.send_signal(signal.SIGINT)
                try:
                    child.wait(STOP_WAIT_S)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
            raise
