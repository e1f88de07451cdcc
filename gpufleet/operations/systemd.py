"""systemd units: running and enabled as wanted; restarts and reloads when another operation changed something."""

from __future__ import annotations

from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.context import host

from gpufleet.operations import node
from gpufleet.operations.node import Commands, gpufleet_operation

RUNNING = ("active", "activating", "reloading")
ENABLED = ("enabled", "enabled-runtime", "static", "alias", "indirect", "generated")


@gpufleet_operation()
def service(unit: str, running: bool | None = True, enabled: bool | None = None) -> Commands:
    """
    Keep a unit running (or stopped) and enabled (or disabled) at boot; None leaves that side alone. A failed
    unit that must run is reset first, so one that hit its start limit starts again.

    + unit: the unit's full name (``node_exporter.service``)
    + running: whether it must run
    + enabled: whether it must start at boot
    """
    found = node.unit(unit)
    changes = []
    if running is True and found["active"] == "failed":  # its start limit may be hit: clear it first
        changes.append(StringCommand("systemctl", "reset-failed", QuoteString(unit)))
    if running is True and found["active"] not in RUNNING:
        changes.append(StringCommand("systemctl", "start", QuoteString(unit)))
    if running is False and found["active"] in RUNNING:
        changes.append(StringCommand("systemctl", "stop", QuoteString(unit)))
    if enabled is True and found["enabled"] not in ENABLED:
        changes.append(StringCommand("systemctl", "enable", QuoteString(unit)))
    if enabled is False and found["enabled"] in ("enabled", "enabled-runtime"):
        changes.append(StringCommand("systemctl", "disable", QuoteString(unit)))
    if not changes:
        host.noop(f"{unit} is {found['active']}, {found['enabled'] or 'no unit file'}")
        return
    node.forget("units", unit)
    yield from changes


@gpufleet_operation(idempotent=False)
def restart(unit: str) -> Commands:
    """
    Restart a unit (starting it when it was stopped); give it an ``_if`` saying why.

    + unit: the unit's full name
    """
    node.forget("units", unit)
    yield StringCommand("systemctl", "restart", QuoteString(unit))


@gpufleet_operation(idempotent=False)
def reload(unit: str) -> Commands:
    """
    Have a running unit read its configuration again (its ExecReload=; started when it was stopped); give it an
    ``_if`` saying why.

    + unit: the unit's full name
    """
    node.forget("units", unit)
    yield StringCommand("systemctl", "reload-or-restart", QuoteString(unit))


@gpufleet_operation(idempotent=False, counts_as_drift=False)
def stop(unit: str, fresh_start_limit: bool = False) -> Commands:
    """
    Stop a unit now (it stays enabled); give it an ``_if`` saying why.

    + unit: the unit's full name
    + fresh_start_limit: also clear its start limit's count (``reset-failed``): the start that follows is a new
      attempt, not one more of a loop (systemd counts every start, the deploy's too, against ``StartLimitBurst``).
      Only a unit that was not inactive: one never started is not loaded, has no count, and reset-failed refuses it
    """
    loaded = fresh_start_limit and node.unit(unit)["active"] != "inactive"
    node.forget("units", unit)
    yield StringCommand("systemctl", "stop", QuoteString(unit))
    if loaded:
        yield StringCommand("systemctl", "reset-failed", QuoteString(unit))


@gpufleet_operation(idempotent=False)
def daemon_reload() -> Commands:
    """
    Make systemd read its unit files again; give it an ``_if`` naming the unit file that changed.
    """
    yield StringCommand("systemctl", "daemon-reload")


@gpufleet_operation()
def retired(pattern: str, keep: list[str], unit: str, paths: list[str], suffix: str = "") -> Commands:
    """
    Stop, disable and remove what a plan no longer has on this node: every ``NAME`` whose path matches
    ``pattern`` (its base name less what the pattern's base name has before ``*``, less ``suffix``) and is not
    in ``keep`` loses its unit and its files.

    + pattern: absolute glob of what marks a ``NAME`` present (``/etc/gpufleet/vllm/*``)
    + keep: the names still planned here
    + unit: the unit of a ``NAME``, ``{name}`` filled in (``vllm@{name}.service``)
    + paths: the files of a ``NAME`` to remove, ``{name}`` filled in
    + suffix: what to strip from a matching base name to get ``NAME``
    """
    prefix = pattern.rsplit("/", 1)[-1].split("*", 1)[0]  # gpufleet-ray-*.service: gpufleet-ray-
    stale = sorted(name for found in node.listing(pattern)
                   if (name := found.rsplit("/", 1)[-1].removeprefix(prefix).removesuffix(suffix)) not in keep)
    if not stale:
        host.noop(f"nothing retired: {', '.join(keep) or 'none'} planned")
        return
    node.forget("listings", pattern)
    for name in stale:
        node.forget("units", unit.format(name=name))
        for path in paths:
            node.forget("paths", path.format(name=name))
        yield StringCommand("systemctl", "disable", "--now", QuoteString(unit.format(name=name)), "||", "true")
        yield StringCommand("rm", "-rf", "--", *(QuoteString(p.format(name=name)) for p in paths))
