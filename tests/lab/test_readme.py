"""The README's tour, each command as written, on the lab (scenario ``faults``, after the bench's and the capacity's
tests, before the upgrades): the console blocks print what they show; the ``sh`` blocks' commands succeed. Its
bench is tests/lab/test_bench.py's (twice, its record the pipeline shape's), its upgrade and rollback
tests/lab/test_upgrade.py's: they run them as the README writes them, adding only where to write the report."""

from __future__ import annotations

import json
import re
import stat
import subprocess
from pathlib import Path

import pytest

from tests.lab.fleet import served_name
from tests.lab.harness import Completed, Lab
from tests.lab.readme_tour import run, shows, starting, tour

pytestmark = pytest.mark.filterwarnings("ignore:Unknown ssh-ed25519 host key:UserWarning")

RUN_ELSEWHERE = ("gpufleet bench ", "gpufleet upgrade ", "gpufleet rollback ")  # test_bench.py's, test_upgrade.py's
COMMAND_TIMEOUT_S = 900


def test_the_tours_console_blocks_print_what_they_show(lab: Lab, faults: Completed | None) -> None:
    shown = [command for command in tour() if command.shown is not None]
    assert len(shown) >= 3, shown
    for command in shown:
        done = run(lab, command, COMMAND_TIMEOUT_S)
        assert command.shown is not None and shows(command.shown, done.stdout + done.stderr), (
            command.line, done.stdout[-3000:], done.stderr[-3000:])


def test_the_tours_commands_work_as_written_on_the_lab(lab: Lab, faults: Completed | None) -> None:
    commands = [c for c in tour() if c.shown is None and not c.line.startswith(RUN_ELSEWHERE)]
    assert [c.argv[:2] for c in commands][:1] == [["make", "lab"]], commands
    figures = {}
    for command in commands:
        done = run(lab, command, COMMAND_TIMEOUT_S)
        assert done.returncode == 0, (command.line, done.stdout[-3000:], done.stderr[-3000:])
        figures[command.line] = done.stdout.strip().splitlines()[-2:]
    elsewhere = sorted(c.argv[1] for c in tour() if c.line.startswith(RUN_ELSEWHERE))
    assert elsewhere == ["bench", "rollback", "upgrade"], elsewhere
    print(json.dumps({"readme_tour": figures}))


def test_the_first_request_is_one_copy_away(lab: Lab, faults: Completed | None) -> None:
    """The curl line ``gpufleet lab client`` prints gets a completion through the virtual address, run as printed;
    its key is read from a 0600 header file, on no command line and in no output."""
    shown = run(lab, starting("gpufleet lab client"), COMMAND_TIMEOUT_S)
    assert shown.returncode == 0, shown.stderr[-2000:]
    curl = shown.stdout.strip().splitlines()[-1]
    assert curl.startswith("curl ") and "Authorization" not in curl, curl
    headers = Path(re.findall(r" -H @(\S+) ", curl)[0])
    assert stat.S_IMODE(headers.stat().st_mode) == 0o600
    key = headers.read_text().split("Bearer ", 1)[1].strip()
    assert key and key not in shown.stdout + shown.stderr and key not in curl
    answered = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
    assert answered.returncode == 0, (answered.stdout[-2000:], answered.stderr[-2000:])
    completion = json.loads(answered.stdout)
    assert completion["model"] == served_name("lab") and completion["choices"][0]["text"], completion
