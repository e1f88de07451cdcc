"""Reading YAML variable files strictly: UTF-8 only, each key once, aliases that cannot blow up, numbers in
decimal only (YAML 1.1's octal, hexadecimal, binary, underscored and base-60 integers are text, refused where a
number is expected).

PyYAML's ``safe_load`` keeps the last of two equal keys, decodes with a traceback on a bad byte, and
lets a few lines of anchors expand into billions of values when anything walks the result.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from gpufleet.values.grammar import secret_like

MAX_VALUES = 10_000
"""The most values (scalars, lists, mappings) a file may hold once its aliases are expanded."""

MAX_DEPTH = 64
"""The deepest nesting of lists and mappings a file may have (gpufleet's own values nest a few levels)."""

_MERGE_TAG = "tag:yaml.org,2002:merge"
_OPEN = (yaml.SequenceStartEvent, yaml.MappingStartEvent)
_CLOSE = (yaml.SequenceEndEvent, yaml.MappingEndEvent)


def _check_depth(text: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH from the event stream, before anything recurses over it."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, _OPEN):
            depth += 1
            if depth > MAX_DEPTH:
                mark = event.start_mark
                raise YamlProblem(f"expected lists and mappings nested at most {MAX_DEPTH} levels deep, found deeper",
                                  f":{mark.line + 1}:{mark.column + 1}" if mark is not None else "")
        elif isinstance(event, _CLOSE):
            depth -= 1


class YamlProblem(ValueError):
    """Bad YAML; ``where`` is ``:line`` or ``:line:column``, empty when the whole file is to blame."""

    def __init__(self, message: str, where: str = "") -> None:
        super().__init__(message)
        self.message, self.where = message, where


def _expanded_size(node: Node, memo: dict[int, int]) -> int:
    """How many values ``node`` stands for once every alias is expanded (stops counting past MAX_VALUES)."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = MAX_VALUES + 1  # a node that contains itself expands forever
    if isinstance(node, SequenceNode):
        size = 1 + sum(_expanded_size(child, memo) for child in node.value)
    elif isinstance(node, MappingNode):
        size = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    else:
        size = 1
    memo[id(node)] = min(size, MAX_VALUES + 1)
    return memo[id(node)]


_YAML_TAGS = "tag:yaml.org,2002:"  # what !! stands for
_INT_TAG, _FLOAT_TAG = f"{_YAML_TAGS}int", f"{_YAML_TAGS}float"
DECIMAL_INT = re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$")
"""An integer as every gpufleet input spells one: ASCII decimal digits, no leading zero (YAML 1.1 would read
``017`` as octal, ``0x1F``, ``0b101``, ``1_000`` and ``1:30`` as numbers too, where ``--data`` reads them otherwise)."""
_DECIMAL_FLOAT = re.compile(r"^[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$|^[-+]?\.(?:inf|Inf|INF)$"
                            r"|^\.(?:nan|NaN|NAN)$")


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the constructor reports it
            if first is not None:
                raise YamlProblem(f"{key}: expected each key once, found it again (first on line {first})",
                                  f":{line}")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: ScalarNode) -> int:
        """An integer, or one line where it has more digits than Python converts (its ``int`` raises ValueError)."""
        digits = len(str(node.value).lstrip("+-"))
        if digits > sys.get_int_max_str_digits():
            raise YamlProblem(f"expected a number, found an integer of {digits:,} digits",
                              f":{node.start_mark.line + 1}:{node.start_mark.column + 1}")
        return int(yaml.SafeLoader.construct_yaml_int(self, node))


_StrictLoader.yaml_implicit_resolvers = {  # SafeLoader's, less YAML 1.1's numbers: decimal ones only
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_StrictLoader.add_constructor(_INT_TAG, _StrictLoader.construct_yaml_int)
_StrictLoader.add_implicit_resolver(_INT_TAG, DECIMAL_INT, list("-+0123456789"))
_StrictLoader.add_implicit_resolver(_FLOAT_TAG, _DECIMAL_FLOAT, list("-+0123456789."))


def _check_tags(text: str) -> None:
    """No explicit tag (``!!int``, ``!!python/...``, ``!custom``): gpufleet's inputs are plain YAML, read one way, and
    a tagged value would be converted before any check could name it (its text, a key or a token, in the error)."""
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        tag = getattr(event, "tag", None)
        if tag is not None and tag != "!":  # "!": a quoted or non-specific scalar, plain text
            mark = event.start_mark
            short = "!!" + tag.removeprefix(_YAML_TAGS) if tag.startswith(_YAML_TAGS) else tag
            shown = "a tag that looks like a credential (not shown)" if secret_like(tag) else f"the tag {short}"
            where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
            raise YamlProblem(f"expected plain YAML without tags, found {shown}", where)


def load_yaml(data: bytes) -> Any:
    """Parse one YAML document from raw bytes; raises YamlProblem with a line where there is one."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise YamlProblem(
            f"expected UTF-8 text, found byte 0x{data[exc.start]:02x} at byte offset {exc.start}"
        ) from None
    loader = None
    try:
        _check_depth(text)
        _check_tags(text)
        loader = _StrictLoader(text)
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, {}) > MAX_VALUES:
            raise YamlProblem(f"expected at most {MAX_VALUES:,} values with anchors and aliases expanded,"
                              " found more (an alias bomb?)")
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        what = (getattr(exc, "problem", None) or str(exc)).splitlines()[0]  # not the parser's "in <unicode string>"
        raise YamlProblem(f"YAML syntax error: {what}", f":{mark.line + 1}:{mark.column + 1}" if mark else "") from None
    except RecursionError:
        raise YamlProblem("expected YAML nested at most a few hundred levels deep, found deeper") from None
    finally:
        if loader is not None:
            loader.dispose()
