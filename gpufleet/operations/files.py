"""Files, directories and links, compared with the node's reading (owner, mode, sha256, link target)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from io import BytesIO
from pathlib import Path
from uuid import uuid4

from pyinfra.api.arguments import ConnectorArguments
from pyinfra.api.command import FileUploadCommand, QuoteString, StringCommand
from pyinfra.context import host

from gpufleet.digest import file_sha256
from gpufleet.operations import node
from gpufleet.operations.node import Commands, fail, gpufleet_operation

# What runs as the SSH user itself, whatever the operation's privilege arguments say.
# pyinfra types _su_user as str, yet None (no su) is its own default for it (Config.SU_USER).
AS_SSH_USER: ConnectorArguments = {"_sudo": False, "_su_user": None, "_doas": False}  # type: ignore[typeddict-item]


def _owner_and_mode(path: str, user: str, group: str, mode: str) -> Commands:
    found = node.path(path)
    if (found.get("user"), found.get("group")) != (user, group):
        node.forget("paths", path)
        yield StringCommand("chown", f"{user}:{group}", QuoteString(path))
    if int(found.get("mode") or "0", 8) != int(mode, 8):
        node.forget("paths", path)
        yield StringCommand("chmod", mode, QuoteString(path))


@gpufleet_operation()
def directory(path: str, user: str = "root", group: str = "root", mode: str = "0755") -> Commands:
    """
    Keep a directory at ``path`` with this owner and mode (parents are created as needed).

    + path: absolute path
    + user, group: owner
    + mode: octal mode
    """
    changes = list(_directory(path, user, group, mode))
    if not changes:
        host.noop(f"directory {path} is as wanted")
    yield from changes


def _directory(path: str, user: str, group: str, mode: str) -> Commands:
    """What :func:`directory` yields (without its noop: :func:`tree` reports once for all)."""
    found = node.path(path)
    if found["type"] == "missing":
        node.forget("paths", path)
        yield StringCommand("mkdir", "-p", QuoteString(path))
        yield StringCommand("chown", f"{user}:{group}", QuoteString(path))
        yield StringCommand("chmod", mode, QuoteString(path))
        return
    if found["type"] != "directory":
        yield fail(f"{path}: expected a directory, found a {found['type']}")
        return
    yield from _owner_and_mode(path, user, group, mode)


def _content(content: str | bytes | None, src: str | None) -> tuple[str, Callable[[], bytes]]:
    """The wanted digest, and how to get the bytes (read from ``src`` only when they must be uploaded)."""
    if (content is None) == (src is None):
        raise ValueError("expected exactly one of content and src")
    if src is not None:
        return file_sha256(src), Path(src).read_bytes
    data = content.encode() if isinstance(content, str) else bytes(content or b"")
    return hashlib.sha256(data).hexdigest(), lambda: data


@gpufleet_operation()
def file(dest: str, content: str | bytes | None = None, src: str | None = None, user: str = "root",
         group: str = "root", mode: str = "0644") -> Commands:
    """
    Keep ``dest`` holding ``content`` (or the controller's file ``src``) with this owner and mode. A new content
    is uploaded beside ``dest``, given its owner and mode, and renamed over it: readers never see half a file.

    + dest: remote path
    + content: the text or bytes, or
    + src: a file on the controller
    + user, group: owner
    + mode: octal mode
    """
    changes = list(_file(dest, *_content(content, src), user, group, mode))
    if not changes:
        host.noop(f"{dest} is up to date")
    yield from changes


def file_commands(dest: str, content: str, user: str = "root", group: str = "root", mode: str = "0644") -> Commands:
    """What :func:`file` yields to keep ``dest`` holding ``content``, for an operation that decides the content
    itself when it runs (nothing when the node's reading has it so already)."""
    yield from _file(dest, *_content(content, None), user, group, mode)


def _file(dest: str, digest: str, data: Callable[[], bytes], user: str, group: str, mode: str) -> Commands:
    """What :func:`file` yields (without its noop: :func:`tree` reports once for all)."""
    found = node.path(dest)
    if found["type"] not in ("file", "missing"):
        yield fail(f"{dest}: expected a file, found a {found['type']}")
        return
    if found["type"] == "missing" or found.get("sha256") != digest:
        node.forget("paths", dest)
        staged = f"{dest}.gpufleet-new"
        if found["type"] == "missing":
            yield StringCommand("mkdir", "-p", QuoteString(str(Path(dest).parent)))
        yield FileUploadCommand(BytesIO(data()), staged)
        yield StringCommand("chown", f"{user}:{group}", QuoteString(staged))
        yield StringCommand("chmod", mode, QuoteString(staged))
        yield StringCommand("mv", "-fT", QuoteString(staged), QuoteString(dest))
        return
    yield from _owner_and_mode(dest, user, group, mode)


@gpufleet_operation()
def secret_file(dest: str, content: str, mode: str = "0600", group: str = "root") -> Commands:
    """
    Keep ``dest`` (owned by root and ``group``, in a directory only they may enter) holding ``content``; the
    secret is never shown in a diff or a log and never readable by another user at any moment, also when the SSH
    user is not root and pyinfra runs with ``_sudo``: the upload goes into a fresh 0700 directory of the SSH
    user's (``mkdir`` fails rather than reuse one), and the destination exists as an empty root file with its
    final owner and mode before any content arrives (``cp`` into an existing file keeps its mode). A failed step
    can leave the upload only inside that directory.

    + dest: remote path
    + content: the secret text (never logged)
    + mode: octal mode
    + group: the file's group (a service account that reads it: ``haproxy``, ``keepalived``)
    """
    yield from secret_commands(dest, content, mode, group)


def secret_commands(dest: str, content: str, mode: str = "0600", group: str = "root") -> Commands:
    """What :func:`secret_file` yields, for an operation that decides the secret itself."""
    found = node.path(dest)
    if found["type"] not in ("file", "missing"):  # touch, chown, chmod and cp would follow a link
        yield fail(f"{dest}: expected a file, found a {found['type']}")
        return
    if found.get("sha256") != hashlib.sha256(content.encode()).hexdigest():
        node.forget("paths", dest)
        staging = host.get_temp_filename(f"gpufleet-secret-{uuid4()}")
        yield StringCommand("mkdir", "-m", "700", QuoteString(staging), **AS_SSH_USER)
        yield StringCommand("touch", QuoteString(dest))
        yield StringCommand("chown", f"root:{group}", QuoteString(dest))
        yield StringCommand("chmod", mode, QuoteString(dest))
        yield FileUploadCommand(BytesIO(content.encode()), dest, remote_temp_filename=f"{staging}/upload")
        yield StringCommand("rm", "-rf", QuoteString(staging), **AS_SSH_USER)
        return
    yield from owner_and_mode(dest, "root", group, mode, f"{dest} holds the secret")


def owner_and_mode(path: str, user: str, group: str, mode: str, kept: str) -> Commands:
    """Give ``path`` this owner and mode; ``kept`` is the noop's line when it has them already."""
    changes = list(_owner_and_mode(path, user, group, mode))
    if not changes:
        host.noop(kept)
    yield from changes


@gpufleet_operation()
def link(path: str, target: str) -> Commands:
    """
    Keep ``path`` a symbolic link to ``target`` (replaced with one rename when it points elsewhere).

    + path: the link
    + target: what it points to
    """
    found = node.path(path)
    if found["type"] == "link" and found.get("target") == target:
        host.noop(f"{path} points to {target}")
        return
    if found["type"] not in ("link", "missing"):
        yield fail(f"{path}: expected a symbolic link, found a {found['type']}")
        return
    node.forget("paths", path)
    staged = f"{path}.gpufleet-new"
    yield StringCommand("ln", "-sfn", QuoteString(target), QuoteString(staged))
    yield StringCommand("mv", "-fT", QuoteString(staged), QuoteString(path))


@gpufleet_operation()
def absent(path: str) -> Commands:
    """
    Remove ``path`` (a file, a link or a whole directory) when it exists.

    + path: absolute path
    """
    if node.path(path)["type"] == "missing":
        host.noop(f"{path} does not exist")
        return
    node.forget("paths", path)
    yield StringCommand("rm", "-rf", "--", QuoteString(path))


@gpufleet_operation()
def pruned(pattern: str, keep: list[str]) -> Commands:
    """
    Remove what matches ``pattern`` except the paths in ``keep`` (superseded downloads, stale units).

    + pattern: an absolute glob (see :class:`gpufleet.facts.node.NodeState` ``listings``)
    + keep: paths to leave alone
    """
    stale = [found for found in node.listing(pattern) if found not in keep]
    if not stale:
        host.noop(f"nothing but {', '.join(keep) or 'nothing'} matches {pattern}")
        return
    node.forget("listings", pattern)
    for path in stale:
        node.forget("paths", path)
    yield StringCommand("rm", "-rf", "--", *(QuoteString(path) for path in stale))


def local_tree(src: str) -> tuple[list[str], dict[str, Path]]:
    """The directories (relative, parents first) and files (relative -> local path) below ``src``."""
    root = Path(src)
    dirs = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir())
    found = {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}
    return dirs, found


def tree_paths(src: str, dest: str) -> tuple[list[str], list[str]]:
    """What :func:`tree` compares: every remote path, and the listing pattern of every remote directory."""
    dirs, found = local_tree(src)
    return ([dest, *(f"{dest}/{d}" for d in dirs), *(f"{dest}/{f}" for f in found)],
            [f"{dest}/*", *(f"{dest}/{d}/*" for d in dirs)])


@gpufleet_operation()
def tree(src: str, dest: str, user: str = "root", group: str = "root", mode: str = "0644",
         dir_mode: str = "0755") -> Commands:
    """
    Make the directory ``dest`` an exact copy of the controller's directory ``src``: files uploaded where
    their sha256 differs, what ``src`` lacks removed.

    + src: a directory on the controller
    + dest: the directory on the node
    + user, group: owner of everything
    + mode, dir_mode: octal modes of files and directories
    """
    dirs, found = local_tree(src)
    changes: list[object] = []
    for directory_path in [dest, *(f"{dest}/{d}" for d in dirs)]:
        changes += list(_directory(directory_path, user, group, dir_mode))
    wanted = {dest, *(f"{dest}/{d}" for d in dirs), *(f"{dest}/{f}" for f in found)}
    for pattern in [f"{dest}/*", *(f"{dest}/{d}/*" for d in dirs)]:
        extra = [p for p in node.listing(pattern) if p not in wanted]
        if extra:
            node.forget("listings", pattern)
            changes.append(StringCommand("rm", "-rf", "--", *(QuoteString(p) for p in extra)))
    for relative, local in found.items():
        changes += list(_file(f"{dest}/{relative}", file_sha256(local), local.read_bytes, user, group, mode))
    if not changes:
        host.noop(f"{dest} matches {src}: {len(found)} files")
    yield from changes
