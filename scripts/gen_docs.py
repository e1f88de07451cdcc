#!/usr/bin/env python3
"""Write the reference pages of docs/reference/ and the roles' defaults.yml from the code: ``make docs``.

- ``roles/<role>/defaults.yml``: each variable's meaning and default, from its record in the role's settings
  (``gpufleet/config/settings/<role>.py``, :mod:`gpufleet.config.settings`);
- ``variables.md``: every variable: its meaning, its default, who must agree on it, and its type and range from the
  typed schema (:class:`gpufleet.config.schema.HostConfig`: annotations, constraints and the docstrings of its
  validators);
- ``commands.md``: every ``gpufleet`` command's ``--help``, from the click commands themselves;
- ``roles.md``: every role's module docstring (``roles/<role>/__init__.py``).

The files are never edited by hand. The output depends on the sources only (a fixed help width, sorted roles), and
``tests/unit/test_docs.py`` fails when a committed page differs from what this script writes.

Usage: ``python scripts/gen_docs.py`` writes the pages; ``--check`` writes nothing and exits 1 when one is stale.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import json
import pkgutil
import re
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import annotated_types
import click
import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator
from pydantic.fields import FieldInfo

if TYPE_CHECKING:
    from gpufleet.config.settings import Setting

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # document this tree's gpufleet, whichever the interpreter has installed
REFERENCE = Path("docs") / "reference"
HELP_WIDTH = 100
REGENERATE = "python scripts/gen_docs.py"
_RST_ROLE = re.compile(r":(?:mod|func|class|data|meth|attr):`~?([^`]+)`")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def banner(sources: str) -> str:
    """The first line of a generated page: where it comes from and how to regenerate it."""
    return f"<!-- Generated from {sources} by scripts/gen_docs.py: do not edit; run `make docs`. -->\n"


# --- text ---------------------------------------------------------------------------------------------------------

def escape(text: str) -> str:
    """Markdown text with ``<`` and ``*`` shown as written outside code spans (``<version>`` is no HTML tag)."""
    pieces = []
    at = 0
    for span in _CODE_SPAN.finditer(text):
        pieces.append(_escape_plain(text[at:span.start()]))
        pieces.append(span.group(0))
        at = span.end()
    pieces.append(_escape_plain(text[at:]))
    return "".join(pieces)


def _escape_plain(text: str) -> str:
    """``\\``, ``*`` and a ``<`` that could open an HTML tag, escaped."""
    return re.sub(r"<(?=[A-Za-z/!?])", r"\\<", text.replace("\\", "\\\\").replace("*", "\\*"))


def rst_to_markdown(text: str) -> str:
    """A docstring's reStructuredText as Markdown: ````x```` and ``:mod:`x``` become code spans."""
    text = _RST_ROLE.sub(r"``\1``", text)
    text = re.sub(r"``(.+?)``", lambda m: f"`{m.group(1)}`", text, flags=re.S)
    return escape(text)


def one_line(text: str) -> str:
    """A docstring as one line of Markdown."""
    return rst_to_markdown(" ".join(text.split()))


def comment_markdown(lines: tuple[str, ...]) -> str:
    """A defaults.yml comment as Markdown: lines joined into paragraphs, indented lines kept as a code block."""
    blocks: list[str] = []
    prose: list[str] = []
    code: list[str] = []

    def flush() -> None:
        if prose:
            blocks.append(escape(" ".join(prose)))
            prose.clear()
        if code:
            indent = min(len(line) - len(line.lstrip()) for line in code if line.strip())
            blocks.append("```\n" + "\n".join(line[indent:] for line in code) + "\n```")
            code.clear()

    for line in lines:
        if not line.strip():
            flush()
        elif line.startswith("  "):
            if prose:
                flush()
            code.append(line)
        else:
            if code:
                flush()
            prose.append(line.strip())
    flush()
    return "\n\n".join(blocks)


# --- the roles' settings and their defaults.yml -------------------------------------------------------------------

COMMENT_WIDTH = 116
"""A defaults.yml comment's text is wrapped to this width (``# `` and the text fit 118 columns)."""


def role_settings() -> dict[str, type[BaseModel]]:
    """Every role's settings model, by role name (``gpufleet/config/settings/<role>.py``)."""
    import gpufleet.config.settings as package
    from gpufleet.config.settings import RoleSettings

    found: dict[str, type[BaseModel]] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda info: info.name):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        (model,) = [value for value in vars(module).values() if isinstance(value, type)
                    and issubclass(value, RoleSettings) and value is not RoleSettings
                    and value.__module__ == module.__name__]
        found[info.name] = model
    return found


def doc_lines(text: str) -> tuple[str, ...]:
    """A record's meaning (or a role's docstring) as comment lines: prose wrapped, a line that starts with a blank
    (a table, an example) kept as written, a blank line kept."""
    lines: list[str] = []
    for line in text.split("\n"):
        if not line.strip() or line.startswith(" "):
            lines.append(line.rstrip())
        else:
            lines += textwrap.wrap(line, COMMENT_WIDTH, break_long_words=False, break_on_hyphens=False)
    return tuple(lines)


def yaml_value(value: Any) -> str:
    """A default as defaults.yml writes it: YAML on one line (``null``, ``auto``, ``0.33.0``, ``'4'``, ``[1, 2]``)."""
    text: str = yaml.safe_dump(value, default_flow_style=True, width=1 << 20, sort_keys=False)
    return text.removesuffix("\n...\n").strip()


def _comment(lines: tuple[str, ...]) -> list[str]:
    return [f"# {line}".rstrip() for line in lines]


def defaults_file(role: str, model: type[BaseModel]) -> str:
    """``roles/<role>/defaults.yml``: the role's docstring, then each variable's meaning and default, in the order
    of its settings' fields, under its section's heading."""
    from gpufleet.config.settings import records

    out = [f"# Written by `make docs` from gpufleet/config/settings/{role}.py, where each variable is one record.",
           "#", *_comment(doc_lines(inspect.cleandoc(model.__doc__ or "")))]
    section = ""
    for record in sectioned(records(model, role).values()):
        if record.section != section:
            section = record.section
            out += ["", f"# --- {section} ".ljust(COMMENT_WIDTH + 2, "-")]
        else:
            out.append("")
        out += [*_comment(doc_lines(record.doc)), f"{record.name}: {yaml_value(record.default)}"]
    return "\n".join(out).rstrip() + "\n"


def sectioned(found: Iterable[Setting]) -> list[Setting]:
    """Records in order, their sections checked: each section one run of records, and none after a section left
    unnamed (it would print an empty heading)."""
    listed = list(found)
    seen: list[str] = []
    for record in listed:
        if not seen or record.section != seen[-1]:
            if record.section in seen or (seen and not record.section):
                raise ValueError(f"{record.name}: expected its role's sections each in one run of records, found"
                                 f" section {record.section!r} again")
            seen.append(record.section)
    return listed


def defaults_files() -> dict[Path, str]:
    """Every role's defaults.yml, by path relative to the project."""
    return {Path("roles") / role / "defaults.yml": defaults_file(role, model)
            for role, model in role_settings().items()}


# --- the schema's types -------------------------------------------------------------------------------------------

@dataclass
class Words:
    """What a type's description collects besides its text: its validators' rules (their docstrings) and, by name,
    the mappings (pydantic models, dataclasses) it holds, each with its keys."""

    rules: list[str] = dataclasses.field(default_factory=list)
    mappings: dict[str, str] = dataclasses.field(default_factory=dict)

    def rule(self, func: Callable[..., Any]) -> None:
        """Add a validator's docstring (its first paragraph), once."""
        if (doc := first_paragraph(func)) and doc not in self.rules:
            self.rules.append(doc)


def first_paragraph(obj: Any) -> str | None:
    """The first paragraph of an object's docstring, on one line."""
    doc = getattr(obj, "__func__", obj).__doc__
    return " ".join(doc.split("\n\n")[0].split()) if doc else None


def _bounds(meta: list[Any]) -> str:
    low = high = ""
    for item in meta:
        if isinstance(item, annotated_types.Ge):
            low = f"{item.ge} ≤ "
        elif isinstance(item, annotated_types.Gt):
            low = f"{item.gt} < "
        elif isinstance(item, annotated_types.Le):
            high = f" ≤ {item.le}"
        elif isinstance(item, annotated_types.Lt):
            high = f" < {item.lt}"
    return f"{low}x{high}" if low or high else ""


def _flat_metadata(meta: list[Any]) -> list[Any]:
    """Constraints and validators, with those inside a ``Field(...)`` taken out of it."""
    flat: list[Any] = []
    for item in meta:
        flat += _flat_metadata(item.metadata) if isinstance(item, FieldInfo) else [item]
    return flat


def _choices(meta: list[Any]) -> list[Any] | None:
    """The values a ``Field(json_schema_extra={"enum": [...]})`` lists, if any."""
    for item in meta:
        extra = item.json_schema_extra if isinstance(item, FieldInfo) else None
        if isinstance(extra, dict) and isinstance(extra.get("enum"), list):
            return typing.cast(list[Any], extra["enum"])
    return None


def _annotated(base: Any, meta: list[Any], words: Words) -> str:
    """A type with its constraints (``integer, 1 ≤ x ≤ 65535``); each validator's docstring becomes a rule."""
    flat = _flat_metadata(meta)
    parts = [describe_type(base, words)]
    if choices := _choices(meta):
        parts = ["one of " + ", ".join(f"`{choice}`" for choice in choices)]
    if bounds := _bounds(flat):
        parts.append(bounds)
    parts += [f"matching `{item.pattern}`" for item in flat if getattr(item, "pattern", None)]
    for item in flat:
        if isinstance(item, BeforeValidator | AfterValidator):
            words.rule(item.func)
    return ", ".join(parts)


def _mapping(model: type[Any], words: Words) -> str:
    """A pydantic model or dataclass as a mapping of its keys; the keys' types go to ``words.mappings``."""
    names = list(model.model_fields) if issubclass(model, BaseModel) else [f.name for f in dataclasses.fields(model)]
    if model.__name__ not in words.mappings:
        words.mappings[model.__name__] = ""  # a model inside itself is described once
        hints = typing.get_type_hints(model, include_extras=True)
        defaults = {} if issubclass(model, BaseModel) else {f.name: f.default for f in dataclasses.fields(model)}
        keys = []
        for name in names:
            inner = Words(mappings=words.mappings)
            text = describe_type(hints[name], inner)
            rules = f" ({' '.join(inner.rules)})" if inner.rules else ""
            default = f", default `{json.dumps(defaults[name])}`" if name in defaults else ""
            keys.append(f"`{name}`: {text}{rules}{default}")
        checks = [doc for check in _model_checks(model) if (doc := first_paragraph(check))]
        words.mappings[model.__name__] = " ".join(
            [f"{first_paragraph(model)} Keys: {'; '.join(keys)}.", *checks])
    return "mapping (" + ", ".join(f"`{name}`" for name in names) + ")"


def _model_checks(model: type[Any]) -> list[Callable[..., Any]]:
    if not issubclass(model, BaseModel):
        return []
    return [decorator.func for decorator in model.__pydantic_decorators__.model_validators.values()]


def describe_type(tp: Any, words: Words) -> str:
    """A schema annotation in words (``integer, 1 ≤ x ≤ 1024, or `auto```)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Annotated:
        return _annotated(args[0], list(tp.__metadata__), words)
    if origin in (Union, types.UnionType):
        shown = [describe_type(arg, words) for arg in args if arg is not type(None)]
        return ", or ".join(shown + (["null"] if type(None) in args else []))
    if origin is Literal:
        return "one of " + ", ".join(f"`{value}`" for value in args) if len(args) > 1 else f"`{args[0]}`"
    if origin is list:
        return f"list of ({describe_type(args[0], words)})"
    if origin is tuple:
        items = {describe_type(arg, words) for arg in args}
        return f"list of {len(args)} ({items.pop()})" if len(items) == 1 else f"list of {len(args)} items"
    if origin is dict:
        value = "any value" if args[1] is Any else describe_type(args[1], words)
        return f"mapping of {describe_type(args[0], words)} to {value}"
    if isinstance(tp, type) and (issubclass(tp, BaseModel) or dataclasses.is_dataclass(tp)):
        return _mapping(tp, words)
    names = {bool: "true or false", int: "integer", float: "number", str: "text"}
    if tp in names:
        return names[tp]
    raise ValueError(f"no words for the type {tp!r}: teach scripts/gen_docs.py describe_type")


def field_type(name: str) -> tuple[str, Words]:
    """A schema field's type in words, and its rules: its validators' docstrings, the mappings it holds."""
    from gpufleet.config.schema import HostConfig

    field = HostConfig.model_fields[name]
    words = Words()
    annotation: Any = field.annotation
    text = _annotated(annotation, list(field.metadata), words) if field.metadata else describe_type(annotation, words)
    if choices := _choices([field]):
        text = "one of " + ", ".join(f"`{choice}`" for choice in choices)
    for decorator in HostConfig.__pydantic_decorators__.field_validators.values():
        if name in decorator.info.fields:
            words.rule(decorator.func)
    return text, words


# --- the pages ----------------------------------------------------------------------------------------------------

def variables_page(root: Path = ROOT) -> str:
    """docs/reference/variables.md: every variable, by role."""
    from gpufleet.config.settings import records

    roles = role_settings()
    out = [banner("gpufleet/config/settings/*.py"), "# Variables\n",
           "Every variable a host's configuration holds, by role (the fleet-wide ones: role `fleet`). Each is one"
           " record, a field of its role's settings in `gpufleet/config/settings/<role>.py`: its type and range,"
           " its default (also in `roles/<role>/defaults.yml`, written from the records), its meaning, and who must"
           " agree on it. Which source wins where several set a variable: [the guide's"
           " Configuration](../guide/configuration.md#precedence).\n"]
    for role, model in roles.items():
        links = ", ".join(f"[`{name}`](#{name})" for name in model.model_fields)
        out.append(f"- [{role}](#role-{role}): {links}")
    out.append("")
    for role, model in roles.items():
        out.append(f"## Role {role}\n")
        out.append(comment_markdown(doc_lines(inspect.cleandoc(model.__doc__ or ""))) + "\n")
        section = ""
        for record in sectioned(records(model, role).values()):
            if record.section != section:
                section = record.section
                out.append(f"### {escape(section)}\n")
            out.append(_variable(record))
    return "\n".join(out).rstrip() + "\n"


SCOPES = {"pool": "every host of one pool (one model, one layout)", "routers": "every router (the edge)",
          "vrrp": "every router of the VRRP group"}


def _variable(record: Setting) -> str:
    """One variable's entry: its type and rules, its default, who must agree on it, its meaning."""
    text, words = field_type(record.name)
    lines = [f"#### `{record.name}`\n", f"- type: {escape(text)}"]
    lines += [f"- rule: {one_line(rule)}" for rule in words.rules]
    lines += [f"- `{name}`: {one_line(keys)}" for name, keys in words.mappings.items()]
    lines.append(f"- default: `{yaml_value(record.default)}`")
    if record.scope in SCOPES:
        lines.append(f"- the same on: {SCOPES[record.scope]}")
    if record.model_wide:
        lines.append(f"- the same for every pool that serves one model name {escape(record.model_wide)}")
    if record.secret:
        lines.append("- secret: a reference, never shown" if record.secret != "tree"
                     else "- secret: holds secret references, never shown")
    lines += ["", comment_markdown(doc_lines(record.doc)) + "\n"]
    return "\n".join(lines)


def _commands(command: click.Command, ctx: click.Context) -> Iterator[tuple[click.Command, click.Context]]:
    yield command, ctx
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None:
                yield from _commands(sub, click.Context(sub, info_name=name, parent=ctx))


def commands_page() -> str:
    """docs/reference/commands.md: every ``gpufleet`` command's ``--help``."""
    from gpufleet.cli.main import main

    root = click.Context(main, info_name="gpufleet", terminal_width=HELP_WIDTH, max_content_width=HELP_WIDTH)
    found = list(_commands(main, root))
    out = [banner("the click commands of gpufleet/cli*.py"), "# Commands\n",
           "Every `gpufleet` command, as its `--help` prints it. Bad input never shows a traceback: one line per"
           " problem, exit 2 (see [the guide's Configuration](../guide/configuration.md#bad-input)).\n"]
    out += [f"- [`{ctx.command_path}`](#{slug(ctx.command_path)}): {escape(command.get_short_help_str(300))}"
            for command, ctx in found[1:]]
    out.append("")
    for command, ctx in found:
        out += [f"## {ctx.command_path}\n", "```text", command.get_help(ctx).rstrip(), "```\n"]
    return "\n".join(out).rstrip() + "\n"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def role_docstring(path: Path) -> str:
    """A role's module docstring (read, not imported: roles import pyinfra's deploy machinery)."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        raise ValueError(f"{path}: a role's module needs a docstring that says what the node has after it")
    return doc


def roles_page(root: Path = ROOT) -> str:
    """docs/reference/roles.md: every role's module docstring."""
    paths = sorted((root / "roles").glob("*/__init__.py"))
    out = [banner("roles/*/__init__.py"), "# Roles\n",
           "One pyinfra deploy per role, `roles/<role>/__init__.py`; what follows is each module's docstring: what a"
           " node has after the role ran. The order a deploy runs them in: [the guide's Deploys](../guide/deploys.md)."
           " Each role's variables: [Variables](variables.md) (`roles/fleet/` holds the fleet-wide ones and no"
           " deploy).\n"]
    out += [f"- [{path.parent.name}](#{path.parent.name})" for path in paths]
    out.append("")
    for path in paths:
        out += [f"## {path.parent.name}\n", rst_to_markdown(role_docstring(path)) + "\n"]
    return "\n".join(out).rstrip() + "\n"


PAGES: dict[str, Callable[[Path], str]] = {
    "variables.md": variables_page,
    "commands.md": lambda root: commands_page(),
    "roles.md": roles_page,
}


def pages(root: Path = ROOT) -> dict[Path, str]:
    """Every written file's path (relative to the project) and text: the reference pages and the roles'
    defaults.yml."""
    return {**{REFERENCE / name: render(root) for name, render in PAGES.items()}, **defaults_files()}


def stale(root: Path = ROOT) -> list[Path]:
    """The written files (reference pages, defaults.yml) whose committed text is not what this script writes."""
    return [path for path, text in pages(root).items()
            if not (root / path).is_file() or (root / path).read_text() != text]


def main(argv: list[str] | None = None) -> int:
    """Write the reference pages, or with ``--check`` name the stale ones (exit 1)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page is stale")
    args = parser.parse_args(argv)
    if args.check:
        found = stale()
        for path in found:
            print(f"{path} is stale: run `make docs` ({REGENERATE})", file=sys.stderr)
        return 1 if found else 0
    for path, text in pages().items():
        (ROOT / path).parent.mkdir(parents=True, exist_ok=True)
        (ROOT / path).write_text(text)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
