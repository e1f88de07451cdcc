"""``gpufleet bench-client``: install the bench's client (guidellm) on this machine from the hash-pinned lock gpufleet
ships, or download the lock's wheels for an air-gapped controller (:mod:`gpufleet.measure.client_env`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click
from click.core import ParameterSource

from gpufleet.cli.inputs import fail_lines
from gpufleet.measure import client_env
from gpufleet.measure import guidellm_client as client

EXIT_FAILED = 1


@click.command("bench-client")
@click.option("--wheelhouse", metavar="DIR", envvar=client.WHEELHOUSE_ENV, show_envvar=True,
              help="Install offline from this directory of wheels alone (pip --no-index --find-links DIR), as an"
                   " air-gapped controller does; --download fills one.")
@click.option("--find-links", "find_links", metavar="DIR|URL", multiple=True,
              help="Also look for wheels there, beside the package index (torch's CPU build, which PyPI lacks; pip's"
                   " own configuration applies too). The lock's pins and hashes still decide what is installed. Not"
                   " with --wheelhouse, whose install looks in the wheelhouse alone.")
@click.option("--download", metavar="DIR",
              help="Download the lock's wheels into DIR (checked against its hashes, for its target whatever this"
                   " machine is) instead of installing: the wheelhouse to carry to an air-gapped controller.")
@click.option("--force", is_flag=True, help="Install again even when the installed client matches the lock.")
def bench_client_command(wheelhouse: str | None, find_links: tuple[str, ...], download: str | None,
                         force: bool) -> None:
    """Install gpufleet bench's client, guidellm, on this machine from the hash lock gpufleet ships.

    Into its own virtual environment, ~/.cache/gpufleet/guidellm-<version>: exactly the lock's pinned wheels,
    each checked against its sha256 (pip --no-deps --require-hashes), nothing else. gpufleet bench and gpufleet
    upgrade --canary-bench install nothing: they refuse a client missing or installed from another lock."""
    lock_file = client_env.lock_path(client.VERSION)
    try:
        lock = client_env.read_lock(lock_file)
    except client_env.LockError as exc:
        fail_lines([f"gpufleet bench-client: {exc}"])
    _refuse_bad_sources(wheelhouse, find_links, download)
    dest = Path(download) if download is not None else None
    if dest is not None and (problem := client_env.directory_problem(dest)):
        fail_lines([f"gpufleet bench-client: --download: expected a directory to download the wheels into, found"
                    f" {download!r} ({problem})"])
    base = client.cache_home().parent
    if dest is None and (problem := client_env.directory_problem(client.client_venv().parent, base)):
        name = "XDG_CACHE_HOME" if os.environ.get("XDG_CACHE_HOME") else "XDG_CACHE_HOME (unset: ~/.cache)"
        fail_lines([f"gpufleet bench-client: {name}: expected a directory to keep the client in, found {str(base)!r}"
                    f" ({problem})"])
    started = time.monotonic()
    try:
        if dest is not None:
            wheels = client_env.download(lock_file, lock, dest, find_links)
            click.echo(f"gpufleet bench-client: {len(lock.pins)} wheels of {lock_file.name} in {download}"
                       f" ({len(wheels)} wheels there, {time.monotonic() - started:.0f} s)")
            return
        venv = client.client_venv()
        if problem := client_env.interpreter_problem(lock.target):
            fail_lines([f"gpufleet bench-client: {problem}"])
        if put_back := client_env.recover(venv):
            click.echo(f"gpufleet bench-client: {put_back}")
        if not force and client_env.check(venv, lock_file, "guidellm") is None:
            click.echo(f"gpufleet bench-client: guidellm {client.VERSION} in {venv} is installed from {lock_file.name}")
            return
        client_env.install(venv, lock_file, "guidellm", wheelhouse=wheelhouse, find_links=find_links,
                           say=lambda line: click.echo(f"gpufleet bench-client: {line}"))
    except (client_env.InstallError, OSError) as exc:
        click.echo(f"gpufleet bench-client: {exc}", err=True)
        raise SystemExit(EXIT_FAILED) from None
    click.echo(f"gpufleet bench-client: guidellm {client.VERSION} installed in {venv} from {lock_file.name}"
               f" ({len(lock.pins)} wheels, {time.monotonic() - started:.0f} s)")


def _refuse_bad_sources(wheelhouse: str | None, find_links: tuple[str, ...], download: str | None) -> None:
    """One line, exit 2, for an empty or missing wheelhouse (given, or :data:`~client.WHEELHOUSE_ENV` set to
    nothing: an offline install was meant), an empty --find-links or --download, and sources that do not go
    together: a wheelhouse with --download (which fills one) or with --find-links (an offline install looks in the
    wheelhouse alone)."""
    from_env = click.get_current_context().get_parameter_source("wheelhouse") is ParameterSource.ENVIRONMENT
    name = client.WHEELHOUSE_ENV if from_env else "--wheelhouse"
    if wheelhouse is None and os.environ.get(client.WHEELHOUSE_ENV) == "":
        fail_lines([f"gpufleet bench-client: {client.WHEELHOUSE_ENV}: expected a directory of wheels, found ''"
                    " (unset it to install from the package index)"])
    if wheelhouse is not None and download is not None:
        fail_lines([f"gpufleet bench-client: --download: expected no {name} with it (it fills one)"])
    if wheelhouse is not None and find_links:
        fail_lines([f"gpufleet bench-client: --find-links: expected no {name} with it (an offline install looks in"
                    f" the wheelhouse alone), found --find-links {find_links[0]!r}"])
    if wheelhouse is not None and (not wheelhouse or ("://" not in wheelhouse and not Path(wheelhouse).is_dir())):
        fail_lines([f"gpufleet bench-client: {name}: expected a directory of wheels, found {wheelhouse!r}"])
    if "" in find_links:
        fail_lines(["gpufleet bench-client: --find-links: expected a directory or URL of wheels, found ''"])
    if download == "":
        fail_lines(["gpufleet bench-client: --download: expected a directory to download the wheels into, found ''"])
