"""What a node reports of the paths, units, packages and accounts the roles manage, in one reading
(paired with :mod:`gpufleet.operations.node`)."""

from __future__ import annotations

import base64
import re
from collections.abc import Sequence
from typing import Any, TypedDict

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.facts import FactBase


class PathState(TypedDict, total=False):
    type: str  # file, directory, link, other, missing
    mode: str  # octal without leading zeros, as stat prints it ("644")
    user: str
    group: str
    sha256: str  # regular files only
    target: str  # links only


class UnitState(TypedDict):
    active: str  # systemd's ActiveState: active, inactive, failed, activating, ...
    enabled: str  # systemd's UnitFileState: enabled, disabled, static, "" when no unit file


class AccountState(TypedDict):
    uid: int
    group: str  # primary group's id, as getent prints it
    home: str
    shell: str


class NodeStateValue(TypedDict):
    paths: dict[str, PathState]
    texts: dict[str, str | None]
    units: dict[str, UnitState]
    packages: dict[str, str]
    users: dict[str, AccountState]
    groups: dict[str, int]
    listings: dict[str, list[str]]


_FUNCTIONS = (
    't() { if [ -f "$1" ]; then printf "T\\t%s\\t%s\\n" "$1" "$(head -c 4096 -- "$1" | base64 -w0)";'
    ' else printf "T\\t%s\\t-\\n" "$1"; fi; };'
    ' l() { pattern="$1"; shift; printf "L\\t%s\\t\\n" "$pattern";'
    ' for f in "$@"; do if [ -e "$f" ] || [ -L "$f" ]; then printf "L\\t%s\\t%s\\n" "$pattern" "$f"; fi; done; };'
)
# One find for every path (type, mode, owner, group, link target), one sha256sum for every regular file among them.
_PATH_LINE = "-printf 'P\\t%p\\t%y\\t%m\\t%u\\t%g\\t%l\\n'"
_PATH_TYPES = {"f": "file", "d": "directory", "l": "link"}
_GLOB = re.compile(r"/[A-Za-z0-9_./@*?+:=-]+")


class NodeState(FactBase[NodeStateValue]):
    """
    Returns, in one command, the state of everything an operation compares against: paths (type, mode, owner,
    the sha256 of a regular file, the target of a link), the first 4 KiB of small text files, systemd units
    (active and unit-file state), installed Debian packages (version), accounts and groups, and the paths that
    match a glob. Paths cost one ``find`` and one ``sha256sum`` for all of them. A path that does not exist, an
    absent unit, package, account or group has no key (a unit systemd does not know is ``inactive`` with no
    unit-file state).

    + paths: absolute paths to stat (and hash, when regular files)
    + texts: small files whose text to read (markers); None when the file is missing
    + units: systemd unit names
    + packages: Debian package names
    + users: account names
    + groups: group names
    + listings: absolute glob patterns (letters, digits, ``_./@*?+:=-`` only) whose matches to list

    .. code:: python

        {
            "paths": {"/etc/gpufleet": {"type": "directory", "mode": "755", "user": "root", "group": "root"}},
            "texts": {"/opt/vllm/0.33.0/.gpufleet-installed": "{...}"},
            "units": {"vllm@lab.service": {"active": "active", "enabled": "enabled"}},
            "packages": {"procps": "2:4.0.2-3"},
            "users": {"vllm": {"uid": 998, "group": "996", "home": "/var/lib/vllm", "shell": "/usr/sbin/nologin"}},
            "groups": {"vllm": 996},
            "listings": {"/etc/gpufleet/vllm/*": ["/etc/gpufleet/vllm/lab"]},
        }
    """

    def command(
        self, paths: Sequence[str] = (), texts: Sequence[str] = (), units: Sequence[str] = (),
        packages: Sequence[str] = (), users: Sequence[str] = (), groups: Sequence[str] = (),
        listings: Sequence[str] = (),
    ) -> StringCommand:
        parts: list[Any] = [_FUNCTIONS]
        if paths:
            for path in paths:
                if not path.startswith("/"):
                    raise ValueError(f"expected an absolute path, found {path!r}")
            quoted = [QuoteString(path) for path in paths]
            parts += ["find", *quoted, "-maxdepth", "0", _PATH_LINE, "2>/dev/null", ";",
                      "find", *quoted, "-maxdepth", "0", "-type", "f", "-exec", "sha256sum", "--", "{}", "+",
                      "2>/dev/null", "|", "sed", "'s/^/H\\t/'", ";"]
        for path in texts:
            parts += ["t", QuoteString(path), ";"]
        for pattern in listings:
            if not _GLOB.fullmatch(pattern):
                raise ValueError(f"expected an absolute glob of letters, digits and _./@*?+:=-, found {pattern!r}")
            parts += ["l", QuoteString(pattern), pattern, ";"]  # the second copy unquoted: the shell expands it
        if units:
            parts += ["systemctl", "show", "--property=Id,ActiveState,UnitFileState", "--",
                      *(QuoteString(u) for u in units), "2>/dev/null", "|", "sed", "'s/^/S\\t/'", ";"]
        if packages:
            parts += ["dpkg-query", "-W", "-f='D\\t${Package}\\t${Version}\\t${db:Status-Abbrev}\\n'", "--",
                      *(QuoteString(p) for p in packages), "2>/dev/null", ";"]
        if users:
            parts += ["getent", "passwd", *(QuoteString(u) for u in users), "|", "sed", "'s/^/W\\t/'", ";"]
        if groups:
            parts += ["getent", "group", *(QuoteString(g) for g in groups), "|", "sed", "'s/^/G\\t/'", ";"]
        parts.append("true")
        return StringCommand(*parts)

    @staticmethod
    def default() -> NodeStateValue:  # pyinfra's value when the command prints nothing
        return empty_node_state()

    def process(self, output: list[str]) -> NodeStateValue:
        return parse_node_state(output)


def empty_node_state() -> NodeStateValue:
    return {"paths": {}, "texts": {}, "units": {}, "packages": {}, "users": {}, "groups": {}, "listings": {}}


def parse_node_state(output: list[str]) -> NodeStateValue:
    """The lines :class:`NodeState`'s command prints, as its value."""
    found = empty_node_state()
    unit: dict[str, str] = {}
    digests: dict[str, str] = {}

    def end_unit() -> None:
        if unit.get("Id"):
            found["units"][unit["Id"]] = {"active": unit.get("ActiveState", ""),
                                          "enabled": unit.get("UnitFileState", "")}
        unit.clear()

    for line in output:
        kind, _, rest = line.partition("\t")
        fields = rest.split("\t")
        if kind == "P" and len(fields) >= 6:
            path, what = fields[0], _PATH_TYPES.get(fields[1], "other")
            entry: PathState = {"type": what}
            if what in ("file", "directory"):
                entry.update({"mode": fields[2], "user": fields[3], "group": fields[4]})
            if what == "link":
                entry["target"] = fields[5]
            found["paths"][path] = entry
        elif kind == "H" and len(rest) > 66 and rest[64:66] == "  ":  # sha256sum: "<digest>  <path>"
            digests[rest[66:]] = rest[:64]
        elif kind == "T":
            found["texts"][fields[0]] = None if fields[1] == "-" else base64.b64decode(fields[1]).decode(
                "utf-8", "replace")
        elif kind == "L":
            matches = found["listings"].setdefault(fields[0], [])
            if fields[1]:
                matches.append(fields[1])
        elif kind == "S":
            if not rest:
                end_unit()
            else:
                key, _, value = rest.partition("=")
                unit[key] = value
        elif kind == "D":
            if len(fields) >= 3 and fields[2][1:2] == "i":  # status installed: "ii ", held "hi ", "ri "...
                found["packages"][fields[0]] = fields[1]
        elif kind == "W":
            name, _, uid, gid, _, home, shell = (rest.split(":") + [""] * 7)[:7]
            found["users"][name] = {"uid": int(uid or -1), "group": gid, "home": home, "shell": shell}
        elif kind == "G":
            name, _, gid = (rest.split(":") + [""] * 3)[:3]
            found["groups"][name] = int(gid or -1)
    end_unit()
    for path, entry in found["paths"].items():
        if entry["type"] == "file" and path in digests:
            entry["sha256"] = digests[path]
    return found
