"""The shape of an inventory file: its groups, each a list of hosts, and every host kept or the file refused.

pyinfra takes a module-level list (or ``(list, {data})`` tuple) of host names and ``(name, {data})`` pairs as a
group, and skips anything else without a word: a stray ``42`` in a list, a set, a ``routers`` group given as a
string. Here every public name that holds a collection must be such a group, each entry a host; a host is listed
once per group, spelled one way (case, a trailing dot), and in serving groups that nest (the later one, its pool,
inside the earlier ones). Problems carry ``file:line``, read from the file's syntax tree.
"""

from __future__ import annotations

import ast
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet.values import grammar
from gpufleet.values.problems import Problem

ROUTERS_GROUP = "routers"  # the HAProxy routers (role router; keepalived where they share a virtual address)
MONITORING_GROUP = "monitoring"  # the hosts that scrape metrics and alert (role monitoring)
ROLE_GROUPS = (ROUTERS_GROUP, MONITORING_GROUP)
"""Groups that give their hosts a job besides serving (the HAProxy routers, the hosts that scrape metrics): they
are not serving pools, and a host listed only in them serves nothing (no GPU roles, no probe, no plan)."""

_COLLECTIONS = (list, tuple, set, frozenset, dict, range, types.GeneratorType)
_HOSTS_HINT = 'a list of host names and ("name", {data}) pairs, or (that list, {group data})'


@dataclass(frozen=True)
class Group:
    """One inventory group as written: its name, its entries as (host, data), its group data."""

    name: str
    hosts: list[tuple[str, dict[str, Any]]]
    data: dict[str, Any]


class SourceLines:
    """Where each module-level name of a Python file is bound, from its syntax tree (not its run)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.bindings: dict[str, list[ast.stmt]] = {}
        self.mentions: dict[str, list[int]] = {}
        self.calls: list[int] = []
        try:
            tree = ast.parse(path.read_bytes(), str(path))
        except (OSError, SyntaxError, ValueError):
            return
        self._walk(tree.body)

    def _walk(self, body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        self.bindings.setdefault(name.id, []).append(node)
            if not any(isinstance(getattr(node, field, None), list) for field in ("body", "orelse", "finalbody")):
                for name in ast.walk(node):
                    if isinstance(name, ast.Name):
                        self.mentions.setdefault(name.id, []).append(node.lineno)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                func = node.value.func
                if getattr(func, "id", None) == "apply_group_vars" or getattr(func, "attr", None) == "apply_group_vars":
                    self.calls.append(node.lineno)
            for field in ("body", "orelse", "finalbody"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    self._walk(inner)
            for handler in getattr(node, "handlers", []):
                self._walk(handler.body)

    def names(self) -> set[str]:
        """Every public name the file binds at module level."""
        return {name for name in self.bindings if not name.startswith("_")}

    def line_of(self, name: str, index: int | None = None) -> int | None:
        """The line that binds ``name`` last (the line of its ``index``-th item, when a list literal shows it)."""
        nodes = self.bindings.get(name)
        if not nodes:
            return None
        node = nodes[-1]
        value = getattr(node, "value", None)
        if index is not None and isinstance(value, ast.Tuple) and value.elts:
            value = value.elts[0]
        if index is not None and isinstance(value, (ast.List, ast.Set, ast.Tuple)) and index < len(value.elts):
            return value.elts[index].lineno
        return node.lineno

    def late_line(self, name: str) -> int | None:
        """The first line after the last ``apply_group_vars(...)`` call that names ``name``, if any."""
        if not self.calls:
            return None
        after = [line for line in self.mentions.get(name, []) if line > self.calls[-1]]
        return after[0] if after else None


def _kind(value: Any) -> str:
    names = {list: "a list", tuple: "a tuple", set: "a set", frozenset: "a set", dict: "a mapping", str: "text",
             int: "a number", float: "a number", bool: "true or false", type(None): "None", range: "a range"}
    return names.get(type(value), f"a {type(value).__name__}")


def is_group_candidate(name: str, value: Any) -> bool:
    """Whether a module-level name must be a group: public, and a collection (any value for a role group)."""
    if name.startswith("_") or name == "all":
        return False
    if name in ROLE_GROUPS:
        return not isinstance(value, (types.ModuleType, types.FunctionType, type))
    return isinstance(value, _COLLECTIONS)


def _entry(entry: Any) -> tuple[str, dict[str, Any]] | None:
    """A group entry as (host, data): ``"name"`` or ``("name", {data})``; None when it is neither."""
    if isinstance(entry, str):
        return entry, {}
    if (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], dict)
            and all(isinstance(k, str) for k in entry[1])):
        return entry[0], dict(entry[1])
    return None


def read_groups(namespace: dict[str, Any], lines: SourceLines, shown: str) -> tuple[list[Group], list[Problem]]:
    """The inventory's groups in definition order, and what keeps a name from being one."""

    def where(name: str, index: int | None = None) -> str:
        line = lines.line_of(name, index)
        return f"{shown}:{line}" if line else shown

    groups: list[Group] = []
    problems: list[Problem] = []
    for name, value in namespace.items():
        if not is_group_candidate(name, value):
            continue
        entries, data = value, {}  # type: tuple[Any, Any]
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], list):
            entries, data = value
            if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
                problems.append(Problem(where(name), name, f"expected group data as a mapping with text keys,"
                                        f" found {_kind(data) if not isinstance(data, dict) else 'another key'}"))
                continue
        if not isinstance(entries, list):
            hint = "" if name in ROLE_GROUPS else " (a name that is no group starts with _)"
            problems.append(Problem(where(name), name, f"expected {_HOSTS_HINT}, found {_kind(value)}{hint}"))
            continue
        hosts: list[tuple[str, dict[str, Any]]] = []
        for i, item in enumerate(entries):
            named = _entry(item)
            if named is None:
                problems.append(Problem(where(name, i), f"{name}[{i}]", 'expected a host as "name" or'
                                        f' ("name", {{data}}), found {grammar.show(item)}'))
            else:
                hosts.append(named)
        groups.append(Group(name, hosts, dict(data)))
    return groups, problems


def _spelling(host: str) -> str:
    return host.lower().removesuffix(".")


def membership_problems(groups: list[Group], lines: SourceLines, shown: str) -> list[Problem]:
    """A host twice in a group, spelled two ways, or in serving groups that do not nest (the later inside)."""
    problems: list[Problem] = []
    spelled: dict[str, str] = {}
    members: dict[str, set[str]] = {}
    for group in groups:
        line = lines.line_of(group.name)
        at = f"{shown}:{line}" if line else shown
        seen: set[str] = set()
        for host, _ in group.hosts:
            if host in seen:
                problems.append(Problem(at, group.name, f"expected each host once, found {host} twice"))
            seen.add(host)
            first = spelled.setdefault(_spelling(host), host)
            if first != host:
                problems.append(Problem(at, group.name, f"expected one spelling per host, found {first!r} and"
                                        f" {host!r}"))
        members[group.name] = seen
    serving = [g.name for g in groups if g.name not in ROLE_GROUPS]
    for i, earlier in enumerate(serving):
        for later in serving[i + 1:]:
            shared = members[earlier] & members[later]
            if shared and not members[later] <= members[earlier]:
                line = lines.line_of(later)
                host = sorted(shared)[0]
                problems.append(Problem(f"{shown}:{line}" if line else shown, later,
                                        f"expected a host in one serving pool (or in a pool inside a larger group"
                                        f" defined before it), found {host} in {earlier} and {later}"))
    return problems


def late_problems(namespace: dict[str, Any], seen: dict[str, frozenset[str]], lines: SourceLines,
                  shown: str) -> list[Problem]:
    """Groups or hosts that appeared after ``apply_group_vars(globals())`` ran: they got no group_vars and were
    never validated. ``seen``: each group's hosts as that call saw them."""
    groups, _ = read_groups(namespace, lines, shown)
    problems = []
    for group in groups:
        hosts = frozenset(host for host, _ in group.hosts)
        if group.name in seen and hosts <= seen[group.name]:
            continue
        line = lines.late_line(group.name) or lines.line_of(group.name)
        found = (f"{group.name} defined after it" if group.name not in seen
                 else f"{', '.join(sorted(hosts - seen[group.name]))} added to {group.name} after it")
        problems.append(Problem(f"{shown}:{line}" if line else shown, group.name,
                                f"expected every group and host defined before apply_group_vars(globals()),"
                                f" found {found}"))
    return problems
