"""``gpufleet bench-client``: install the bench's client (guidellm) on this machine from the hash-pinned lock gpufleet
ships, or download the lock's wheels for an air-gapped controller (:mod:`gpufleet.bench.client_env`)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from gpufleet.bench import client_env
from gpufleet.bench import guidellm_client as client
from gpufleet.cli.inputs import fail_lines

EXIT_FAILED = 1


@click.command("bench-client")
@click.option("--wheelhouse", metavar="DIR", envvar=client.WHEELHOUSE_ENV, show_envvar=True,
              help="Install offline from this directory of wheels alone (pip --no-index --find-links DIR), as an"
                   " air-gapped controller does; --download fills one.")
@click.option("--find-links", "find_links", metavar="DIR|URL", multiple=True,
              help="Also look for wheels there, beside the package index (torch's CPU build, which PyPI lacks; pip's"
                   " own configuration applies too). The lock's pins and hashes still decide what is installed.")
@click.option("--download", type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="Download the lock's wheels into DIR (checked against its hashes, for its target whatever this"
                   " machine is) instead of installing: the wheelhouse to carry to an air-gapped controller.")
@click.option("--force", is_flag=True, help="Install again even when the installed client matches the lock.")
def bench_client_command(wheelhouse: str | None, find_links: tuple[str, ...], download: Path | None,
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
    if wheelhouse is not None and download is not None:
        fail_lines(["gpufleet bench-client: --download: expected no --wheelhouse with it (it fills one)"])
    if wheelhouse is not None and "://" not in wheelhouse and not Path(wheelhouse).is_dir():
        fail_lines([f"gpufleet bench-client: --wheelhouse: expected a directory of wheels, found {wheelhouse!r}"])
    started = time.monotonic()
    try:
        if download is not None:
            wheels = client_env.download(lock_file, lock, download, find_links)
            click.echo(f"gpufleet bench-client: {len(lock.pins)} wheels of {lock_file.name} in {download}"
                       f" ({len(wheels)} wheels there, {time.monotonic() - started:.0f} s)")
            return
        venv = client.client_venv()
        if problem := client_env.interpreter_problem(lock.target):
            fail_lines([f"gpufleet bench-client: {problem}"])
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
