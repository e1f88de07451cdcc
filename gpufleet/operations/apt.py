"""Debian packages: installed at a version, removed, and package lists refreshed."""

from __future__ import annotations

from collections.abc import Sequence

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.context import host

from gpufleet.operations import node
from gpufleet.operations.node import Commands, gpufleet_operation

APT_GET = ("DEBIAN_FRONTEND=noninteractive", "apt-get", "-y", "-o", "Dpkg::Options::=--force-confdef",
           "-o", "Dpkg::Options::=--force-confold")


def _split(spec: str) -> tuple[str, str | None]:
    name, _, version = spec.partition("=")
    return name, version or None


@gpufleet_operation()
def packages(packages: Sequence[str], no_recommends: bool = False, allow_downgrades: bool = False,
             update_first: bool = False) -> Commands:
    """
    Install ``packages`` (``name`` or ``name=version``) that are missing or at another version; an installed
    package without a version asked for is kept as it is.

    + packages: package names, optionally pinned with ``=version``
    + no_recommends: leave their recommended packages out
    + allow_downgrades: allow apt to go back to a pinned version
    + update_first: refresh the package lists before installing (only when something is missing)
    """
    installed = node.packages(_split(spec)[0] for spec in packages)
    missing = [spec for spec in packages
               if (name_version := _split(spec))[0] not in installed
               or (name_version[1] is not None and installed[name_version[0]] != name_version[1])]
    if not missing:
        host.noop(f"installed: {', '.join(f'{n} {installed[n]}' for n in (_split(s)[0] for s in packages))}")
        return
    for spec in missing:
        node.forget("packages", _split(spec)[0])
    if update_first:
        yield StringCommand(*APT_GET, "update")
    options = (["--no-install-recommends"] if no_recommends else []) + (
        ["--allow-downgrades"] if allow_downgrades else [])
    yield StringCommand(*APT_GET, *options, "install", *(QuoteString(spec) for spec in missing))


@gpufleet_operation()
def removed(packages: Sequence[str], purge: bool = True) -> Commands:
    """
    Remove (and purge) ``packages`` that are installed.

    + packages: package names
    + purge: remove their configuration files too
    """
    installed = node.packages(packages)
    if not installed:
        host.noop(f"not installed: {', '.join(packages)}")
        return
    for name in installed:
        node.forget("packages", name)
    yield StringCommand(*APT_GET, "purge" if purge else "remove", *(QuoteString(n) for n in installed))


@gpufleet_operation(idempotent=False)
def update(sources_file: str | None = None) -> Commands:
    """
    Refresh apt's package lists: all of them, or only those of ``sources_file`` (other sources are neither
    fetched nor dropped); give it an ``_if`` saying why. A failed fetch or a bad signature fails it.

    + sources_file: one ``sources.list`` file to refresh alone
    """
    if sources_file is None:
        yield StringCommand(*APT_GET, "update")
        return
    yield StringCommand(*APT_GET, "update", "--error-on=any", "-o", QuoteString(f"Dir::Etc::SourceList={sources_file}"),
                        "-o", "Dir::Etc::SourceParts=-", "-o", "APT::Get::List-Cleanup=0")
