"""What a rollout runs on the routers (gpufleet/rollout/router_control.py): the real ``router_admin.py``, run here as
the node would run it, against a real HAProxy (Debian's ``haproxy``; tests/tools/router_admin_haproxy.py's). The rest of
what a rollout runs on hosts: tests/unit/remote/test_commands.py."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Collection, Sequence

import pytest

from gpufleet.remote.commands import RemoteResult, command_line
from gpufleet.rollout.router_control import ROUTER_ADMIN, RouterControl, RouterFailure
from tests.tools.router_admin_haproxy import BACKEND, FIRST, SECOND, TOOL, Router


class _ToolOnThisMachine:
    """A Remote that runs router_admin.py here, against the test's HAProxy, as the node would run it."""

    def __init__(self, router: Router) -> None:
        self.router, self.commands = router, list[list[str]]()

    def run(self, host: str, words: Sequence[str], *, timeout_s: float,
            ok_status: Collection[int] = (0,)) -> RemoteResult:
        assert tuple(words[:3]) == ROUTER_ADMIN
        command_line(words)
        self.commands.append([host, *words[3:]])
        done = subprocess.run([sys.executable, "-I", str(TOOL), *words[3:], "--socket", str(self.router.socket)],
                              capture_output=True, text=True, timeout=timeout_s)
        return RemoteResult(done.returncode in ok_status, done.stdout, done.stderr)


def test_the_routers_are_drained_waited_for_put_back_and_read(router: Router) -> None:
    remote = _ToolOnThisMachine(router)
    control = RouterControl(remote, ["rt1", "rt2"])  # two routers: the same HAProxy, asked twice
    view = control.show()
    assert set(view) == {"rt1", "rt2"} and view["rt1"][FIRST].up and view["rt1"][FIRST].backend == BACKEND
    router.answered_by(4)
    control.set_state(BACKEND, FIRST, "drain")
    shown = control.show()["rt2"]
    assert (shown[FIRST].status, shown[FIRST].admin, shown[FIRST].up) == ("DRAIN", "drain", False)
    assert shown[FIRST].req_tot + shown[SECOND].req_tot == 4
    assert control.wait_drained([(BACKEND, FIRST)], 5) == []
    control.set_state(BACKEND, FIRST, "ready")
    assert control.show()["rt1"][FIRST].up
    assert [c[:2] for c in remote.commands if c[1] != "show"] == [
        ["rt1", "set-state"], ["rt2", "set-state"], ["rt1", "wait-drained"], ["rt2", "wait-drained"],
        ["rt1", "set-state"], ["rt2", "set-state"]]


def test_a_request_that_stays_in_flight_is_waited_for_at_most_the_drain_time(router: Router) -> None:
    remote = _ToolOnThisMachine(router)
    control = RouterControl(remote, ["rt1"])
    control.set_state(BACKEND, SECOND, "maint")
    holding = threading.Thread(target=router.get, args=("/hold",), daemon=True)
    holding.start()
    assert router.replicas[FIRST].arrived.wait(5)
    control.set_state(BACKEND, FIRST, "drain")
    left = control.wait_drained([(BACKEND, FIRST)], 0.5)
    assert len(left) == 1 and left[0].startswith(f"router rt1: drain: {BACKEND}/{FIRST}: not drained after")
    router.replicas[FIRST].release.set()
    holding.join(5)
    with pytest.raises(RouterFailure, match=f"^router rt1: set {BACKEND}/nobody drain: backend {BACKEND} has no"):
        control.set_state(BACKEND, "nobody", "drain")
