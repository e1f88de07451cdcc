"""The GPU health watch (gpufleet/node/gpu_watch.py) as its timer runs it, and a systemctl that stands in for a
node's."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import ROOT

WATCH = ROOT / "gpufleet" / "node" / "gpu_watch.py"
CHANGING = ("stop", "start", "reset-failed")  # the verbs that change a unit


class FakeSystemctl:
    """systemctl over a dict of unit -> [ActiveState, UnitFileState]; records every call that changes something."""

    def __init__(self, units: dict[str, list[str]], refuse: tuple[str, ...] = (), marker: Path | None = None) -> None:
        self.units, self.refuse, self.marker = units, refuse, marker
        self.calls: list[list[str]] = []

    def run(self, argv: list[str]) -> tuple[int, str, str]:
        assert argv[0] == "systemctl"
        verb, args = argv[1], argv[2:]
        if verb == "list-units":
            assert args[-1] == "vllm@*.service"
            return 0, "".join(f"{'● ' if s[0] == 'failed' else ''}{name} loaded {s[0]} x vLLM replica (gpufleet)\n"
                              for name, s in self.units.items()), ""
        names = args[args.index("--") + 1:]
        if verb == "show":
            blocks = [f"Id={n}\nActiveState={self.units.get(n, ['inactive', ''])[0]}\n"
                      f"UnitFileState={self.units.get(n, ['inactive', ''])[1]}\n" for n in names]
            return 0, "\n".join(blocks), ""
        assert verb in CHANGING, argv
        if verb == "stop" and self.marker is not None:
            assert self.marker.exists(), "the marker is written before any unit stops"
        self.calls.append(argv[1:])
        if verb in self.refuse:
            return 1, "", f"Failed to {verb} {names[0]}: refused by the test\n"
        for name in names:
            self.units[name] = [{"stop": "inactive", "start": "active", "reset-failed": "inactive"}[verb],
                                self.units.get(name, ["", ""])[1]]
        return 0, "", ""
