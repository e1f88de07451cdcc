"""What a well-formed value looks like: names, ids, addresses, URLs, paths, package specs.

Each check returns ``None`` when the value is fine, else the text of the problem in the form
``expected …, found …``. The settings' types and validators call them; nothing here reads the config.
"""

from __future__ import annotations

import ipaddress
import math
import posixpath
import re
import unicodedata
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from gpufleet.node_paths import MODELS_DIR

# Hugging Face: an optional org, a name of word characters, "-" and "." (no "--" or ".."), at most 96 each.
_HF_PART = r"(?!.*(--|\.\.))[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
HF_REPO_ID = re.compile(rf"^(?:{_HF_PART}/)?{_HF_PART}$")
# A revision: a full commit hash, or a branch or tag name (git's ref rules, restricted to safe characters).
HF_REVISION = re.compile(r"^(?![./-])(?!.*(\.\.|//|@\{|/\.|\.lock$|[./]$))[A-Za-z0-9._/-]{1,128}$")
# What clients send as "model": free text (spaces, $, % and quotes reach vLLM literally), starting with a
# letter or digit, no control character, no surrounding blanks.
SERVED_NAME = re.compile(r"^[A-Za-z0-9](?:[^\x00-\x1f\x7f]{0,126}[^\x00-\x1f\x7f\s])?$")
IFNAME = re.compile(r"^(?!\.{1,2}$)[A-Za-z0-9_.-]{1,15}$")
HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DEB_NAME = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
DEB_VERSION = re.compile(r"^(?:[0-9]+:)?[0-9][A-Za-z0-9.+~]*(?:-[A-Za-z0-9.+~]+)?$")
PIP_NAME = re.compile(r"^(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9])$")
PIP_VERSION = re.compile(
    r"^[0-9]+(?:\.[0-9]+)*(?:(?:a|b|rc)[0-9]+)?(?:\.post[0-9]+)?(?:\.dev[0-9]+)?(?:\+[a-z0-9.]+)?$"
)
SECRET_NAME = re.compile(r"(_KEY|_TOKEN|_SECRET)$|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)


def show(value: Any, limit: int = 60) -> str:
    """A value as a message shows it: ``repr``, cut short; never text that looks like a credential."""
    if value is None:
        return "null"
    if isinstance(value, str) and secret_like(value):
        return "a value that looks like a credential (not shown)"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def decimal(text: str) -> float | None:
    """A number as every command reads one: finite, in ASCII decimal digits (``float`` would also take ``1_0``,
    ``nan`` and other scripts' digits, which YAML reads as text); None for anything else."""
    if not _DECIMAL.fullmatch(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def _matching(pattern: re.Pattern[str], expected: str) -> Callable[[str], str | None]:
    """A check that ``pattern`` matches the whole value, else ``expected <expected>, found <value>``."""
    def check(value: str) -> str | None:
        return None if pattern.match(value) else f"expected {expected}, found {show(value)}"
    check.__doc__ = f"{expected[:1].upper()}{expected[1:]}."
    return check


def control_char(text: str) -> str | None:
    """The first control, format (bidi), line or paragraph separator character in ``text``, escaped."""
    for ch in text:
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            return repr(ch)[1:-1]
    return None


hf_repo_id = _matching(HF_REPO_ID, "a Hugging Face id ([org/]name: letters, digits, '-', '_', '.') or an absolute path")
hf_revision = _matching(HF_REVISION, "a commit hash, branch or tag name")


def model_path(value: str) -> str | None:
    """An absolute model path on the node: normalised and strictly below MODELS_DIR."""
    if posixpath.normpath(value) != value or value.startswith("//"):
        return f"expected a normalised absolute path, found {show(value)}"
    if not value.startswith(MODELS_DIR + "/"):
        return f"expected a path below {MODELS_DIR}/ (gpufleet's model directory), found {show(value)}"
    return None


def node_dir(value: str) -> str | None:
    """An absolute path on the nodes: normalised (no ``.``, ``..`` or repeated ``/``; a final ``/`` allowed), no
    blank or control character."""
    bad = any(ch.isspace() for ch in value) or control_char(value) is not None
    path = value.rstrip("/") or "/"  # a directory may end in /
    if bad or not path.startswith("/") or posixpath.normpath(path) != path or path.startswith("//"):
        return f"expected an absolute normalised path on the nodes, found {show(value)}"
    return None


def controller_path(value: str) -> str | None:
    """A path on the controller: absolute, ``~/…`` or relative; no empty text."""
    if not value.strip() or value != value.strip():
        return f"expected a file path, found {show(value)}"
    return None


ifname = _matching(IFNAME, "a network interface name (1-15 of letters, digits, '_', '.', '-')")


def host_name(value: str) -> str | None:
    """An inventory host: an IP address, an RFC 1123 host name, or a pyinfra connector (``@local``…)."""
    if value.startswith("@"):
        return None
    try:
        ipaddress.ip_address(value)
        return None
    except ValueError:
        pass
    labels = value.removesuffix(".").split(".")
    if len(value) <= 253 and all(HOST_LABEL.match(label) for label in labels):
        return None
    return f"expected an IP address or an RFC 1123 host name, found {show(value)}"


def _plain_ip(value: str) -> str | None:
    try:
        ipaddress.ip_address(value)
        return None
    except ValueError:
        return f"expected an IP address, found {show(value)}"


def ip_address(value: str) -> str | None:
    """An address a service binds: an IP address (a wildcard allowed) without an IPv6 zone (systemd and the services
    read the text after ``%`` their own way), neither multicast nor broadcast."""
    if problem := _plain_ip(value):
        return problem
    address = ipaddress.ip_address(value)
    if "%" in value:
        return f"expected an address without an IPv6 zone (%…), found {show(value)}"
    if address.is_multicast or value == "255.255.255.255":
        return f"expected an address a service can listen on, found {show(value)} (a multicast or broadcast address)"
    return None


def node_address(value: str) -> str | None:
    """A node's own address: one unicast IP (no zone index, not 0.0.0.0 or ::, not multicast or broadcast)."""
    if problem := _plain_ip(value):
        return problem
    address = ipaddress.ip_address(value)
    if "%" in value or address.is_unspecified or address.is_multicast or value == "255.255.255.255":
        return f"expected a node's own unicast address (no zone, not a wildcard or group address), found {show(value)}"
    return None


def ip_network(value: str) -> str | None:
    """An allow list's entry, which an IP filter admits: an address or a CIDR network (host bits zero), written
    as it reads (``10.0.0.0/8``, not ``10.0.0.0/255.0.0.0``; lower case), with no IPv6 zone and no IPv4-mapped
    IPv6, so that it admits what it looks like; everyone only as ``0.0.0.0/0`` or ``::/0``."""
    try:
        network = ipaddress.ip_network(value, strict=True)
    except ValueError:
        return f"expected an IP address or a CIDR network (host bits zero), found {show(value)}"
    if "%" in value:
        return f"expected an address or network without an IPv6 zone (%…), found {show(value)}"
    if isinstance(network, ipaddress.IPv6Network) and network.network_address.ipv4_mapped is not None:
        return f"expected IPv4 written as IPv4 (not ::ffff:…), found {show(value)}"
    canonical = str(network.network_address) if "/" not in value else str(network)
    if value != canonical:
        return f"expected it written {canonical} (as the IP filter reads it), found {show(value)}"
    return None


_USERINFO = re.compile(r"//[^/?#]*@")

PIP_CREDENTIALS = "give vllm_pip_index_credentials, a secret reference"
"""Where a URL's credentials go instead (the default of :func:`url`'s hint)."""
NOT_SECRET_URL = "it is written to a configuration file in plain text; it may not carry a secret"
"""The hint for a URL gpufleet has no credential variable for."""


def _secret_params(value: str) -> list[str]:
    """The names of a URL's query and fragment parameters that name a secret (``?token=…``, ``#access_token=…``)."""
    after = value.partition("?")[2] if "?" in value else ""
    query, _, fragment = after.partition("#")
    fragment = fragment or value.partition("#")[2]
    return [name for part in (query, fragment) for name, _ in parse_qsl(part, keep_blank_values=True)
            if names_secret(name)]


def without_credentials(value: str) -> str:
    """A URL, or text holding one, as a message shows it: its user part, and its query when a parameter names a
    secret, not shown."""
    value = _USERINFO.sub("//(credentials not shown)@", value)
    if _secret_params(value):
        value = re.split(r"[?#]", value, maxsplit=1)[0] + "?(query not shown)"
    return value


def url(value: str, plain_http: bool, schemes: tuple[str, ...] = ("https", "http", "file"),
        credentials_hint: str = PIP_CREDENTIALS) -> str | None:
    """A URL with an allowed scheme (http only when ``plain_http``), a host unless file://, no spaces, no
    credentials (a message never shows them, ``credentials_hint`` says where they go), and a normalised path for
    file://."""
    allowed = [s for s in schemes if s != "http" or plain_http]
    shown = show(without_credentials(value))
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        return f"expected a URL, found {shown}"
    if parts.username is not None or parts.password is not None or _USERINFO.search(value):
        return f"expected a URL without user:password ({credentials_hint}), found {shown}"
    if named := _secret_params(value):
        return (f"expected a URL without credentials in its query ({credentials_hint}), found {shown}"
                f" (with {', '.join(map(repr, named))})")
    if parts.scheme == "http" and "http" in schemes and not plain_http:
        return f"expected an https:// URL (plain http only with allow_plain_http: true), found {shown}"
    if parts.scheme not in allowed:
        return f"expected a URL starting {', '.join(s + '://' for s in allowed)}, found {shown}"
    if not value.isascii():
        return f"expected a URL in ASCII (an international name as xn--…), found {shown}"
    if any(ch.isspace() for ch in value) or (parts.scheme != "file" and not parts.hostname):
        return f"expected a URL, found {shown}"
    if parts.scheme == "file":
        path = parts.path.rstrip("/") or "/"
        if parts.netloc or not path.startswith("/") or posixpath.normpath(path) != path or path.startswith("//"):
            return f"expected file:///absolute/normalised/path, found {shown}"
    return None


_RETENTION = re.compile(r"^([1-9][0-9]{0,5})([hdwy])$")
_HOURS = {"h": 1, "d": 24, "w": 7 * 24, "y": 365 * 24}
MAX_RETENTION_HOURS = 100 * 365 * 24


def retention(value: str) -> str | None:
    """How long Prometheus keeps its data: a whole number and one unit, ``h``, ``d``, ``w`` or ``y``, from 2h
    (one block of Prometheus's storage) to 100y."""
    match = _RETENTION.match(value)
    if match and 2 <= int(match[1]) * _HOURS[match[2]] <= MAX_RETENTION_HOURS:
        return None
    return ("expected a duration from 2h to 100y: a whole number and one unit h, d, w or y (e.g. 15d),"
            f" found {show(value)}")


def deb_package(value: str) -> str | None:
    """A Debian package name, optionally pinned: ``name`` or ``name=version``."""
    name, eq, version = value.partition("=")
    if DEB_NAME.match(name) and (not eq or DEB_VERSION.match(version)):
        return None
    return f"expected a Debian package name (optionally name=version), found {show(value)}"


deb_version = _matching(DEB_VERSION, "a Debian version (e.g. 580.95.05-1)")
pip_name = _matching(PIP_NAME, "a pip project name (letters, digits, '.', '_', '-')")
pip_version = _matching(PIP_VERSION, "a release version (e.g. 2.60.0)")
env_name = _matching(ENV_NAME, "an environment variable name (letters, digits, '_')")


_SECRET_TEXT = re.compile(
    r"(?<![A-Za-z0-9])(hf_|ghp_|gho_|ghs_|ghu_|github_pat_|glpat-|sk-|sk_live_|sk_test_|rk_live_|xox[abpr]-|AKIA"
    r"|ASIA)[A-Za-z0-9_-]{12,}"
    r"|eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}"  # a JWT
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----")
# a name of at most 64 characters, where a word starts: linear in the text (an unbounded name backtracks over every
# start of a long word)
_SECRET_PAIR = re.compile(r"(?<![A-Za-z0-9_.-])([A-Za-z_][A-Za-z0-9_.-]{0,63})\s{0,8}[=:]\s{0,8}\S")


def secret_like(text: str) -> bool:
    """Whether free text (a reason, a host name) holds what looks like a credential: a token of a known issuer's
    shape (hf_, ghp_, sk-, AKIA..., a JWT, a private key) or ``name=value`` whose name names a secret."""
    return bool(_SECRET_TEXT.search(text)) or any(names_secret(m[1]) for m in _SECRET_PAIR.finditer(text))


_HEX_RUN = re.compile(r"[0-9a-fA-F]{32,}")
_SEPARATORS = re.compile(r"[_.\-\s/]")


def random_looking(name: str) -> bool:
    """Whether a name looks drawn rather than chosen, as a key or a token is: a run of 32 hex digits or more, or 24
    characters or more of upper and lower case letters and digits together with no separator between words."""
    if _HEX_RUN.search(name):
        return True
    return (len(name) >= 24 and not _SEPARATORS.search(name) and any(c.isupper() for c in name)
            and any(c.islower() for c in name) and any(c.isdigit() for c in name))


def looks_secret(name: str) -> bool:
    """Whether a variable or flag name says it holds a secret (``*_KEY``, ``*_TOKEN``, ``*PASSWORD*``…)."""
    return bool(SECRET_NAME.search(name.replace("-", "_")))


def names_secret(name: str) -> bool:
    """Whether a key inside a value (a URL's query parameter, a key of a JSON option) names a secret: what
    :func:`looks_secret` finds, and the bare words (``token``, ``key``, ``sig``…) and the signed-URL parameters of
    S3 and Azure."""
    word = re.sub(r"[\s.-]+", "_", name.strip().lower())
    if _TOKENIZER_TOKEN.match(word):
        return False
    return looks_secret(word) or word in SECRET_WORDS or word.startswith(("x_amz_", "x_goog_"))


_TOKENIZER_TOKEN = re.compile(r"^(bos|eos|pad|unk|sep|cls|mask|image|video|audio|start|end)_token$")
"""A tokenizer's special tokens (``eos_token`` in ``hf-overrides``): named ``*_token``, holding no secret."""


SECRET_WORDS = frozenset({"token", "key", "apikey", "secret", "password", "passwd", "pass", "pwd", "auth",
                          "authorization", "credential", "credentials", "sig", "signature", "sas", "sv", "se",
                          "access_token", "auth_token", "private_token", "client_secret", "api_key"})
"""Names that hold a secret by themselves (``sig``, ``se`` and ``sv`` make an Azure SAS)."""
