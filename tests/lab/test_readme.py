"""The README's tour, each command as written, on the lab (scenario ``faults``, after the bench's and the capacity's
tests, before the upgrades): the console blocks print what they show; the ``sh`` blocks' commands succeed, the
bench's with a ceiling kept on the monitoring host. Its upgrade and rollback are tests/lab/test_upgrade.py's, which
run them as the README writes them (under the traffic the README names)."""

from __future__ import annotations

import json

import pytest

from tests.lab.benching import kept_records
from tests.lab.harness import Completed, Lab
from tests.lab.readme_tour import run, shows, tour

pytestmark = pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning")

ROLLOUTS = ("gpufleet upgrade ", "gpufleet rollback ")  # tests/lab/test_upgrade.py runs these
COMMAND_TIMEOUT_S = 900


def test_the_tours_console_blocks_print_what_they_show(lab: Lab, faults: Completed | None) -> None:
    shown = [command for command in tour() if command.shown is not None]
    assert len(shown) >= 3, shown
    for command in shown:
        done = run(lab, command, COMMAND_TIMEOUT_S)
        assert command.shown is not None and shows(command.shown, done.stdout + done.stderr), (
            command.line, done.stdout[-3000:], done.stderr[-3000:])


def test_the_tours_commands_work_as_written_on_the_lab(lab: Lab, faults: Completed | None) -> None:
    commands = [c for c in tour() if c.shown is None and not c.line.startswith(ROLLOUTS)]
    assert [c.argv[:2] for c in commands][:1] == [["make", "lab"]], commands
    figures = {}
    for command in commands:
        done = run(lab, command, COMMAND_TIMEOUT_S)
        assert done.returncode == 0, (command.line, done.stdout[-3000:], done.stderr[-3000:])
        figures[command.line] = done.stdout.strip().splitlines()[-2:]
        if command.argv[:2] == ["gpufleet", "bench"]:
            ceiling = [line for line in done.stdout.splitlines() if line.startswith("ceiling: ")]
            assert ceiling and "record: /var/lib/gpufleet/bench/" in done.stdout, done.stdout[-3000:]
            assert any(doc["scope"] == "routers" for doc in kept_records(lab))
    assert any(c.argv[:2] == ["gpufleet", "bench"] for c in commands)
    print(json.dumps({"readme_tour": figures}))
