"""What the operations know of a node: one reading per role at most, kept per host and forgotten where they change it.

:func:`observe` reads every path, unit, package and account a role manages with one
:class:`~gpufleet.facts.node.NodeState` command. The first reading on a host covers what every role of the deploy
will observe there; while no operation has run a command on the host, a later role finds its items already read
and reads nothing. Once one has, every later role reads all its items again (a package's install changes more than
its own files). An operation asking about something not read (or forgotten, because an earlier operation of this
run changed it) reads it live. :func:`gpufleet_operation` makes a pyinfra operation
that, in read-only mode (``deploys/check.py``), runs nothing and records itself as drift when it would change
something.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from functools import wraps
from typing import Any, ParamSpec

from pyinfra.api.arguments_typed import PyinfraOperation
from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.host import Host
from pyinfra.api.operation import OperationMeta, operation
from pyinfra.context import host, state

from gpufleet.facts.node import AccountState, NodeState, NodeStateValue, PathState, UnitState
from gpufleet.pyinfra_seam import current_host, current_state
from gpufleet.run.context import NodeMemory, deploy_state

Commands = Generator[Any, None, None]
P = ParamSpec("P")


def read_only() -> bool:
    """Whether the running deploy only reads (deploys/check.py): its operations run nothing, and record drift."""
    return current_state() is not None and deploy_state().read_only


def drift(target: Host) -> list[str]:
    """The names of ``target``'s operations that would have changed something, in order (read-only mode)."""
    return list(deploy_state().node(target.name).drift.values())


def _memory() -> NodeMemory:
    """What this deploy's operations know of the current host."""
    return deploy_state().node(current_host().name)


def gpufleet_operation(counts_as_drift: bool = True, runs_when_read_only: bool = False,
                       idempotent: bool = True) -> Callable[[Callable[P, Commands]], PyinfraOperation[P]]:
    """A pyinfra operation that honours read-only mode: it runs nothing there and, when it would have yielded a
    command, records its name as drift (unless ``counts_as_drift`` is false)."""

    def decorate(func: Callable[P, Commands]) -> PyinfraOperation[P]:
        @wraps(func)
        def body(*args: P.args, **kwargs: P.kwargs) -> Commands:
            commands = func(*args, **kwargs)
            if runs_when_read_only or not read_only():
                for command in commands:
                    if state.is_executing:
                        _memory().ran_commands = True
                    yield command
                return
            for _ in commands:
                if counts_as_drift:
                    op_hash = host.current_op_hash
                    assert op_hash is not None, "pyinfra sets the operation's hash while its commands are made"
                    meta = state.get_op_meta(op_hash)
                    _memory().drift[op_hash] = ", ".join(sorted(meta.names))
                break
        return operation(is_idempotent=idempotent)(body)

    return decorate


def _reading() -> NodeStateValue:
    return _memory().reading


def _merge(value: NodeStateValue) -> None:
    reading = _reading()
    for kind in reading:
        reading[kind].update(value[kind])  # type: ignore[literal-required]


def _wanted(paths: Iterable[str], texts: Iterable[str], units: Iterable[str], packages: Iterable[str],
            users: Iterable[str], groups: Iterable[str], listings: Iterable[str]) -> dict[str, list[str]]:
    """Each kind's items, sorted, once each."""
    what = {"paths": paths, "texts": texts, "units": units, "packages": packages, "users": users,
            "groups": groups, "listings": listings}
    return {kind: sorted(set(items)) for kind, items in what.items()}


def observe(name: str, paths: Iterable[str] = (), texts: Iterable[str] = (), units: Iterable[str] = (),
            packages: Iterable[str] = (), users: Iterable[str] = (), groups: Iterable[str] = (),
            listings: Iterable[str] = ()) -> OperationMeta:
    """Add :func:`read_state` for a role's items, and count them into the host's first reading.

    + paths, texts, units, packages, users, groups, listings: see :class:`gpufleet.facts.node.NodeState`
    """
    wanted = _wanted(paths, texts, units, packages, users, groups, listings)
    planned = _memory().observed
    for kind, items in wanted.items():
        planned.setdefault(kind, set()).update(items)
    return read_state(name=name, paths=wanted["paths"], texts=wanted["texts"], units=wanted["units"],
                      packages=wanted["packages"], users=wanted["users"], groups=wanted["groups"],
                      listings=wanted["listings"])


@gpufleet_operation(counts_as_drift=False, runs_when_read_only=True)
def read_state(paths: Iterable[str] = (), texts: Iterable[str] = (), units: Iterable[str] = (),
               packages: Iterable[str] = (), users: Iterable[str] = (), groups: Iterable[str] = (),
               listings: Iterable[str] = ()) -> Commands:
    """
    Read the state of everything the following operations manage, with at most one command; changes nothing.
    The host's first reading also takes in what every later :func:`observe` on it asks for; a later one reads
    what is not known yet, or all its items again once an operation of this deploy ran a command on the host.

    + paths, texts, units, packages, users, groups, listings: see :class:`gpufleet.facts.node.NodeState`
    """
    wanted = _wanted(paths, texts, units, packages, users, groups, listings)
    memory = _memory()
    if memory.ran_commands:
        asked = wanted
    elif not memory.first_read:
        memory.first_read = True
        planned = memory.observed
        asked = {kind: sorted(set(items) | planned.get(kind, set())) for kind, items in wanted.items()}
    else:
        asked = {kind: [item for item in items if not _known(kind, item)] for kind, items in wanted.items()}
    count = sum(len(items) for items in asked.values())
    if count == 0:
        host.noop("nothing it asks for is unknown: read earlier in this deploy, and nothing has run on the node since")
    else:
        _live(**asked)
        host.noop(f"read {count} items of the node's state")
    yield from ()


def _known(kind: str, item: str) -> bool:
    reading: dict[str, Any] = _reading()[kind]  # type: ignore[literal-required]
    return item in reading or (kind, item) in _absent_items()


def _live(**what: list[str]) -> NodeStateValue:
    """Read ``what`` now, remember it, and return the whole reading."""
    asked = {kind: items for kind, items in what.items() if items}
    if asked:
        value = host.get_fact(NodeState, **asked)  # never None: the fact's default is an empty reading
        for path in asked.get("paths", []):
            value["paths"].setdefault(path, {"type": "missing"})
        for path in asked.get("texts", []):
            value["texts"].setdefault(path, None)
        for unit in asked.get("units", []):
            value["units"].setdefault(unit, {"active": "inactive", "enabled": ""})
        for pattern in asked.get("listings", []):
            value["listings"].setdefault(pattern, [])
        _merge(value)
        for kind in ("packages", "users", "groups"):
            _absent_items().update((kind, n) for n in asked.get(kind, []) if n not in value[kind])
    return _reading()


def path(name: str) -> PathState:
    reading = _reading()
    return reading["paths"][name] if name in reading["paths"] else _live(paths=[name])["paths"][name]


def text(name: str) -> str | None:
    reading = _reading()
    return reading["texts"][name] if name in reading["texts"] else _live(texts=[name])["texts"][name]


def unit(name: str) -> UnitState:
    reading = _reading()
    return reading["units"][name] if name in reading["units"] else _live(units=[name])["units"][name]


def listing(pattern: str) -> list[str]:
    reading = _reading()
    return reading["listings"][pattern] if pattern in reading["listings"] else _live(
        listings=[pattern])["listings"][pattern]


def packages(names: Iterable[str]) -> dict[str, str]:
    """Installed versions of ``names`` (a package that is not installed has no key)."""
    wanted = list(names)
    return {n: v for n, v in zip(wanted, (_keyed("packages", n) for n in wanted), strict=True) if v is not None}


def account(name: str) -> AccountState | None:
    found: AccountState | None = _keyed("users", name)
    return found


def group_id(name: str) -> int | None:
    found: int | None = _keyed("groups", name)
    return found


def _absent_items() -> set[tuple[str, str]]:
    """Packages, users and groups read and found absent (an absent one has no key in a reading)."""
    return _memory().absent


def _keyed(kind: str, name: str) -> Any:
    reading: dict[str, Any] = _reading()[kind]  # type: ignore[literal-required]
    if name in reading:
        return reading[name]
    if (kind, name) in _absent_items():
        return None
    found = _live(**{kind: [name]})[kind].get(name)  # type: ignore[literal-required]
    if found is None:
        _absent_items().add((kind, name))
    return found


def forget(kind: str, name: str) -> None:
    """Drop what is known of ``name`` (it is being changed): the next question reads it live."""
    _reading()[kind].pop(name, None)  # type: ignore[literal-required]
    _absent_items().discard((kind, name))


def fail(message: str) -> StringCommand:
    """The one way gpufleet fails a host: a command that prints ``message`` on stderr and exits 1, so pyinfra
    shows it, stops every later operation on that host and names it in the run's report."""
    return StringCommand("echo", QuoteString(message), ">&2;", "exit", "1")
