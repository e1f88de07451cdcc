"""Check ``vllm serve`` flags against catalogs read from the vLLM wheels.

The catalogs (``gpufleet/data/vllm_catalogs/vllm-<version>.json``) list every
option the ``vllm serve`` parser registers; ``removed.json`` names flags vLLM
dropped and what replaces them. Regenerate the catalogs with
``scripts/gen_vllm_catalog.py``.

Options whose value is a vLLM config class (``--compilation-config`` ...) name it
in the catalog, which also lists each class's fields: a JSON object given to such
an option is checked key by key (nested classes included), as vLLM's pydantic
validation would; fields the catalog types as ``any`` accept anything.

The checker is stricter than vLLM in one way on purpose: vLLM's argparse takes
any unambiguous prefix of a flag (``--reasoning-effort`` silently becomes
``--reasoning-effort-map``), so only exact names are accepted here.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

__all__ = [
    "DEFAULT_VLLM_VERSION",
    "SUPPORTED_VLLM_VERSIONS",
    "FlagCatalog",
    "FlagProblem",
    "FlagSpec",
    "RemovedFlag",
    "UnsupportedVersionError",
    "human_int",
    "load_catalog",
]

SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.33.0", "0.32.0", "0.31.0")
DEFAULT_VLLM_VERSION = "0.33.0"

_JSON_TYPES = frozenset({"json", "json_config", "json_or_str"})
_SWITCH_TYPES = frozenset({"bool", "flag"})
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_HUMAN_IN_JSON = re.compile(r"\b\d+(?:\.\d+)?[kKmMgGtT]\b")
_JSON_STRING = re.compile(r'("(?:[^"\\]|\\.)*")')
_OPTIMIZATION_LEVEL = "--optimization-level"

FLAG_FLOORS: dict[str, tuple[int, str]] = {
    "--max-num-seqs": (1, "SchedulerConfig"), "--max-num-batched-tokens": (1, "SchedulerConfig"),
    "--max-num-partial-prefills": (1, "SchedulerConfig"), "--max-long-partial-prefills": (1, "SchedulerConfig"),
    "--num-lookahead-slots": (0, "SchedulerConfig"), "--stream-interval": (1, "SchedulerConfig"),
    "--block-size": (1, "CacheConfig"), "--max-loras": (1, "LoRAConfig"),
    "--cpu-offload-gb": (0, "OffloadConfig"), "--offload-group-size": (0, "OffloadConfig"),
    "--offload-num-in-group": (1, "OffloadConfig"), "--offload-prefetch-step": (0, "OffloadConfig"),
}
"""The smallest value vLLM's config classes take for a count (their pydantic ``Field(ge=…)``/``gt=0``; the catalogs
record types only): flag -> (least value, the class that refuses less). The sizes gpufleet owns (tensor, pipeline,
data parallel, max-model-len) are its own variables, with their own ranges."""


class UnsupportedVersionError(ValueError):
    """A vLLM version without a flag catalog."""


class _BadValue(ValueError):
    """A conversion error whose message is worth showing."""


@dataclass(frozen=True)
class FlagProblem:
    """One problem with one flag."""

    flag: str
    message: str
    #: The dotted path below the flag's JSON value (``pass_config.fuse_norm_quant``), if any.
    subkey: str = ""

    def __str__(self) -> str:
        return f"{self.flag}: {self.message}"


@dataclass(frozen=True)
class FlagSpec:
    """One ``vllm serve`` option as recorded in a catalog."""

    name: str
    option_strings: tuple[str, ...]
    negations: tuple[str, ...]
    action: str
    type: str
    nargs: int | str | None
    choices: tuple[Any, ...] | None
    known_values: tuple[str, ...] | None
    nullable: bool
    normalize: str | None
    default: Any
    help: str
    config_class: str | None = None
    config_keys_dashes: bool = False

    @property
    def takes_value(self) -> bool:
        """Whether the flag is followed by a value (booleans are not)."""
        return self.type not in _SWITCH_TYPES

    @property
    def takes_json(self) -> bool:
        """Whether the flag accepts JSON, and therefore dotted sub-keys."""
        return self.type in _JSON_TYPES

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FlagSpec:
        """Build a spec from one catalog entry."""
        choices, known = data.get("choices"), data.get("known_values")
        return cls(
            name=data["name"],
            option_strings=tuple(data["option_strings"]),
            negations=tuple(data.get("negations") or ()),
            action=data.get("action", "_StoreAction"),
            type=data["type"],
            nargs=data.get("nargs"),
            choices=None if choices is None else tuple(choices),
            known_values=None if known is None else tuple(known),
            nullable=bool(data.get("nullable")),
            normalize=data.get("normalize"),
            default=data.get("default"),
            help=data.get("help", ""),
            config_class=data.get("config_class"),
            config_keys_dashes=bool(data.get("config_keys_dashes")),
        )


@dataclass(frozen=True)
class RemovedFlag:
    """A flag vLLM dropped (or never had on the server) and what to use instead."""

    flag: str
    replacement: str
    reason: str = "removed from vLLM"

    @property
    def message(self) -> str:
        """The problem text, without the flag."""
        return f"{self.reason}; {self.replacement}"


def _normalize(flag: str) -> str:
    """Spell a long flag with dashes, as vLLM does before the first ``.``."""
    if flag.startswith("--"):
        return "--" + flag[2:].replace("_", "-")
    return flag


def _looks_like_flag(token: str) -> bool:
    """Whether argparse would read ``token`` as an option rather than a value."""
    return (
        len(token) > 1
        and token.startswith("-")
        and not _NEGATIVE_NUMBER.match(token)
        and " " not in token
    )


def human_int(raw: str) -> int:
    """Parse ``10G`` / ``1.5k`` / ``4096`` the way vLLM's human_readable_int does."""
    value = raw.strip()
    match = _HUMAN_INT.fullmatch(value)
    if not match:
        return int(value)
    number, suffix = match.groups()
    power = "kmgt".index(suffix.lower()) + 1
    if suffix.islower():
        return int(float(number) * 10 ** (3 * power))
    if "." in number:
        raise _BadValue(f"no decimals with binary suffix {suffix}; did you mean {suffix.lower()}?")
    return int(number) << (10 * power)


def _expand_human_numbers(text: str) -> str:
    """Replace bare ``80m``-style numbers outside JSON strings, as vLLM does."""
    parts = _JSON_STRING.split(text)
    for i in range(0, len(parts), 2):
        parts[i] = _HUMAN_IN_JSON.sub(lambda m: str(human_int(m.group())), parts[i])
    return "".join(parts)


_ASCII_INT = re.compile(r"^-?[0-9]+$")


def _convert(spec: FlagSpec, raw: str) -> Any:
    """Convert ``raw`` like the flag's argparse type; raise ValueError if vLLM would."""
    kind = spec.type
    if kind == "int":
        if not _ASCII_INT.match(raw):  # int() also reads other scripts' digits, blanks and '1_0' (argv gets them)
            raise ValueError(raw)
        return int(raw)
    if kind == "float":
        return float(raw)
    if kind == "human_int":
        return human_int(raw)
    if kind == "human_int_or_auto":
        return -1 if raw.strip() in ("-1", "auto", "AUTO", "Auto") else human_int(raw)
    if kind == "port":
        port = int(raw)
        if not 1024 <= port <= 65535:
            raise _BadValue("must be between 1024 and 65535")
        return port
    if kind == "json":
        return json.loads(raw)
    if kind == "json_config":
        value = json.loads(_expand_human_numbers(raw))
        if not isinstance(value, dict):
            raise _BadValue("not an object")
        return value
    if kind == "json_or_str":
        return json.loads(raw) if re.match(r"(?s)^\s*{.*}\s*$", raw) else raw
    if spec.action == "LoRAParserAction" and raw and not ("=" in raw and "," not in raw):
        module = json.loads(raw)  # not NAME=PATH, so it must be a JSON module spec
        if not isinstance(module, dict) or not {"name", "path"} <= module.keys():
            raise ValueError("not a LoRA module")
        return raw
    if spec.normalize == "lower_underscore":
        return raw.lower().replace("-", "_")
    return raw


_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "human_int": "an integer (suffixes k/m/g/t = 10^3.., K/M/G/T = 2^10..)",
    "human_int_or_auto": "an integer (suffixes k/K/m/M/g/G...) or auto/-1",
    "port": "a port number",
    "json": "valid JSON",
    "json_config": "a JSON object",
    "json_or_str": "valid JSON (it starts with '{')",
}



def _dotted_problem(flag: str, key: str, spec: FlagSpec, negated: bool) -> FlagProblem | None:
    """A dotted sub-key (``--compilation-config.mode``) is only accepted on a flag that takes JSON."""
    if negated or not spec.takes_json:
        return FlagProblem(flag, f"{spec.name} does not take JSON, so {key} is not accepted")
    return None


_FIELD_WORDS = {
    "bool": "a boolean", "int": "an integer", "float": "a number", "str": "a string",
    "list": "a list", "dict": "an object",
}
_BOOL_STRINGS = frozenset({"0", "off", "f", "false", "n", "no", "1", "on", "t", "true", "y", "yes"})
_MAX_NESTING = 32


def _number(value: object) -> float | None:
    """``value`` as pydantic's lax mode reads a number (bools and numeric strings too), or None."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip().replace("_", ""))
        except ValueError:
            return None
    return None


def _scalar_ok(kind: str, value: object) -> bool:
    """Whether pydantic (lax mode) takes ``value`` for a field of this scalar kind."""
    if kind == "str":
        return isinstance(value, str)
    if kind == "bool":
        if isinstance(value, str):
            return value.strip().lower() in _BOOL_STRINGS
        return isinstance(value, (bool, int, float)) and value in (0, 1)
    number = _number(value)
    if kind == "float":
        return number is not None
    return number is not None and number.is_integer()  # int


def _shown(value: object) -> str:
    """A found value as the messages show it."""
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "a list"
    return repr(value)


def _expected(field: Mapping[str, Any]) -> str:
    """What a catalog field descriptor accepts, in words."""
    kind: str = field["type"]
    if kind == "enum":
        return "one of " + ", ".join(str(c) for c in field["choices"])
    if kind == "class":
        return f"an object ({field['class']})"
    if kind == "union":
        return " or ".join(_expected(f) for f in field["of"])
    return _FIELD_WORDS.get(kind, kind)


class FlagCatalog:
    """All ``vllm serve`` options of one vLLM version, and the flag checker."""

    def __init__(
        self,
        version: str,
        specs: list[FlagSpec],
        removed: Mapping[str, RemovedFlag],
        config_classes: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.version = version
        #: Config class name -> {"extra": ..., "fields": {name: descriptor}} (see the generator).
        self.config_classes = dict(config_classes or {})
        self._specs = {spec.name: spec for spec in specs}
        self._lookup: dict[str, tuple[FlagSpec, bool]] = {}
        for spec in specs:
            for opt in spec.option_strings:
                self._lookup[opt] = (spec, opt in spec.negations)
        self._long = sorted(o for o in self._lookup if o.startswith("--"))
        # A flag counts as removed only where this version lacks it.
        self.removed = {f: r for f, r in removed.items() if f not in self._lookup}

    def __len__(self) -> int:
        return len(self._specs)

    def __repr__(self) -> str:
        return f"<FlagCatalog vLLM {self.version}: {len(self)} options>"

    @property
    def names(self) -> tuple[str, ...]:
        """Canonical option names, sorted."""
        return tuple(sorted(self._specs))

    def has(self, flag: str) -> bool:
        """Whether ``flag`` (any alias or negation; dashes optional) is an option."""
        return self._resolve(flag) is not None

    def spec(self, flag: str) -> FlagSpec | None:
        """The option ``flag`` names (any alias or negation), or None."""
        found = self._resolve(flag)
        return found[0] if found else None

    def given(self, args: Mapping[str, object], flag: str) -> tuple[str, object] | None:
        """Where ``args`` (``vllm_extra_args``: names without dashes, with ``-`` or ``_``, an alias or a negation)
        sets option ``flag``: the key as written and the value it means (a negation's true is false); None where
        nothing sets it (vLLM takes the option's ``default``)."""
        for key, value in args.items():
            found = None if "." in key else self._resolve(key.lstrip("-"))
            if found is not None and found[0].name == flag:
                negated = found[1] and isinstance(value, bool)
                return key, not value if negated else value
        return None

    def _resolve(self, flag: str) -> tuple[FlagSpec, bool] | None:
        if not flag.startswith("-"):
            flag = "--" + flag
        return self._lookup.get(_normalize(flag))

    # -- problems ---------------------------------------------------------

    def _unknown(self, flag: str) -> FlagProblem:
        """Explain a flag this version does not have."""
        base = flag.removeprefix("--no-")
        for candidate in (flag, "--" + base if base != flag else None):
            if candidate and candidate in self.removed:
                return FlagProblem(flag, self.removed[candidate].message)
        short = self._lookup.get("-" + flag[2:]) if flag.startswith("--") else None
        if short:
            return FlagProblem(flag, f"unknown flag; -{flag[2:]} (one dash) is the short "
                               f"alias of {short[0].name}")
        plain = self._lookup.get("--" + base)
        if base != flag and plain and not plain[0].takes_value and not plain[0].negations:
            return FlagProblem(flag, f"{plain[0].name} is a plain switch without a --no- form; "
                               "leave it out instead")
        prefixed = [o for o in self._long if o.startswith(flag)] if flag.startswith("--") else []
        if len(prefixed) == 1:
            return FlagProblem(
                flag,
                f"unknown flag in vLLM {self.version}; vLLM would silently read it as "
                f"the prefix of {prefixed[0]}, write the full name",
            )
        if prefixed:
            shown = ", ".join(prefixed[:5]) + (", ..." if len(prefixed) > 5 else "")
            return FlagProblem(
                flag, f"unknown flag in vLLM {self.version} (an ambiguous prefix of {shown})"
            )
        pool = self._long if flag.startswith("--") else list(self._lookup)
        nearest = difflib.get_close_matches(flag, pool, n=1, cutoff=0.0)
        hint = f"; nearest: {nearest[0]}" if nearest else ""
        return FlagProblem(flag, f"unknown flag in vLLM {self.version}{hint}")

    def _value_problem(self, flag: str, spec: FlagSpec, raw: str) -> FlagProblem | None:
        """Check one value of a value-taking flag."""
        if spec.nullable and raw in ("", "None"):
            return None
        try:
            value = _convert(spec, raw)
        except ValueError as exc:
            extra = f" ({exc})" if isinstance(exc, _BadValue) else ""
            detail = _TYPE_WORDS.get(spec.type, spec.type)
            if spec.action == "LoRAParserAction":
                detail = "NAME=PATH or a JSON object with name and path"
            return FlagProblem(flag, f"expects {detail}, got {raw!r}{extra}")
        if isinstance(value, dict) and spec.config_class:
            return next(iter(self.config_problems(flag, spec, value)), None)
        if (floor := FLAG_FLOORS.get(spec.name)) and isinstance(value, (int, float)) and value < floor[0]:
            detail = _TYPE_WORDS.get(spec.type, spec.type).split(" (")[0]
            shown = raw if _ASCII_INT.match(raw) else repr(raw)
            return FlagProblem(flag, f"expects {detail} >= {floor[0]} (vLLM's {floor[1]}), got {shown}")
        if spec.choices is not None and value not in spec.choices:
            return FlagProblem(flag, self._choice_text(value, spec.choices, "invalid choice", ""))
        if (
            spec.known_values is not None
            and isinstance(value, str)
            and value.lower() not in {v.lower() for v in spec.known_values}
            and "." not in value  # an import path or plugin-registered class
        ):
            note = "vLLM rejects it at startup unless a plugin registers it; "
            return FlagProblem(
                flag, self._choice_text(value, spec.known_values, "unknown value", note)
            )
        return None

    # -- nested config objects ----------------------------------------------

    def config_problems(
        self, flag: str, spec: FlagSpec, value: Mapping[Any, Any]
    ) -> list[FlagProblem]:
        """Check a JSON object given to an option whose value is a vLLM config class."""
        if spec.config_class not in self.config_classes:
            return []
        return self._object_problems(flag, spec.config_class, value, "", spec.config_keys_dashes, 0)

    def _object_problems(
        self, flag: str, cls: str, value: Mapping[Any, Any], path: str, dashes: bool, depth: int
    ) -> list[FlagProblem]:
        entry = self.config_classes.get(cls)
        if entry is None or depth > _MAX_NESTING:
            return []
        fields = {f.get("key", name): f for name, f in entry["fields"].items()}
        problems: list[FlagProblem] = []
        for key, sub in value.items():
            name = str(key)
            where = f"{path}.{name}" if path else name
            field = fields.get(name.replace("-", "_") if dashes else name)
            if field is not None:
                problems.extend(self._field_problems(flag, field, sub, where, depth + 1))
            elif entry.get("extra") == "forbid":
                close = difflib.get_close_matches(name, list(fields), n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                problems.append(FlagProblem(
                    f"{flag}.{where}", f"expected a key of {cls}, found {name!r}{hint}", where))
        return problems

    def _field_problems(
        self, flag: str, field: Mapping[str, Any], value: object, where: str, depth: int
    ) -> list[FlagProblem]:
        """Check one value against a field descriptor of the catalog."""
        kind = field["type"]
        if kind == "any" or (value is None and field.get("optional")):
            return []
        ok = True
        if value is None:
            ok = False
        elif kind == "class":
            if isinstance(value, Mapping):
                return self._object_problems(flag, field["class"], value, where, False, depth)
            ok = bool(field.get("loose"))  # a validator converts non-objects first
        elif kind == "union":
            found = [self._field_problems(flag, f, value, where, depth) for f in field["of"]]
            if any(not p for p in found):
                return []
            nested = [p for f, p in zip(field["of"], found, strict=True) if f["type"] == "class"]
            if nested and isinstance(value, Mapping):
                return nested[0]
            ok = False
        elif kind == "list":
            if isinstance(value, (list, tuple)):
                return [p for i, item in enumerate(value)
                        for p in self._field_problems(flag, field["items"], item, f"{where}[{i}]",
                                                      depth + 1)]
            ok = False
        elif kind == "dict":
            if isinstance(value, Mapping):
                return [p for k, item in value.items()
                        for p in self._field_problems(flag, field["values"], item, f"{where}.{k}",
                                                      depth + 1)]
            ok = False
        elif kind == "enum":
            ok = not isinstance(value, (Mapping, list, tuple)) and (
                value in field["choices"] or str(value) in {str(c) for c in field["choices"]})
        elif kind in ("bool", "int", "float", "str"):
            ok = _scalar_ok(kind, value)
        if ok:
            return []
        return [FlagProblem(f"{flag}.{where}",
                            f"expected {_expected(field)}, found {_shown(value)}", where)]

    @staticmethod
    def _choice_text(value: Any, options: tuple[Any, ...], what: str, note: str) -> str:
        names = [str(o) for o in options if o is not None]
        close = difflib.get_close_matches(str(value), names, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"{what} {value!r} ({note}choose from {', '.join(names)}){hint}"

    # -- argv -------------------------------------------------------------

    def check_argv(self, args: list[str]) -> list[FlagProblem]:
        """Check what follows ``vllm serve``; the first bare token is the model."""
        problems: list[FlagProblem] = []
        models: list[str] = []
        model_flag = False
        configs = 0
        i = 0
        while i < len(args):
            token = args[i]
            i += 1
            if token == "--":
                models.extend(args[i:])
                break
            if not _looks_like_flag(token):
                models.append(token)
                continue
            if token.startswith("-O") and not token.startswith("--"):
                i = self._check_optimization(token, args, i, problems)
                continue
            key, eq, explicit = token.partition("=")
            base, dot, _sub = key.partition(".")
            flag = _normalize(base)
            if flag == "--config":
                configs += 1
                if eq:
                    problems.append(FlagProblem(
                        flag, f"vLLM silently ignores {token}; write --config FILE (two tokens)"))
                elif dot:
                    problems.append(FlagProblem(flag, "--config takes a file, not sub-keys"))
                elif i >= len(args) or _looks_like_flag(args[i]):
                    problems.append(FlagProblem(flag, "expects a YAML file"))
                else:
                    if not args[i].endswith((".yaml", ".yml")):
                        problems.append(FlagProblem(
                            flag, f"vLLM only reads .yaml/.yml files, got {args[i]!r}"))
                    i += 1
                continue
            model_flag = model_flag or (flag == "--model" and not dot)
            found = self._lookup.get(flag)
            if found is None:
                problems.append(self._unknown(flag))
                if not eq and not dot and i < len(args) and not _looks_like_flag(args[i]):
                    i += 1  # most likely its value: do not call it a second model
                continue
            spec, negated = found
            if dot:
                if (dotted := _dotted_problem(flag, key, spec, negated)) is not None:
                    problems.append(dotted)
                elif not eq and i >= len(args):
                    problems.append(FlagProblem(key, "expects a value"))
                if not eq:
                    i += 1  # vLLM takes the next token as the value, whatever it is
                continue
            if not spec.takes_value:
                if eq:
                    problems.append(FlagProblem(
                        flag, f"is a boolean switch and takes no value; {self._switch_hint(spec)}"))
                continue
            values, i = ([explicit], i) if eq else self._take_values(spec, args, i)
            problems.extend(self._count_problems(flag, spec, values))
            problems.extend(p for v in values if (p := self._value_problem(flag, spec, v)))
        if configs > 1:
            problems.append(FlagProblem("--config", "given more than once (vLLM allows one)"))
        if len(models) > 1:
            problems.append(FlagProblem(
                models[1], f"unexpected positional argument(s) {' '.join(models[1:])}; "
                "only the model is positional"))
        if model_flag and models:
            problems.append(FlagProblem("--model", "model given twice (positional and --model)"))
        return problems

    def _check_optimization(
        self, token: str, args: list[str], i: int, problems: list[FlagProblem]
    ) -> int:
        """``-O3``, ``-O=3`` and ``-O 3`` (0-3 only) mean ``--optimization-level``."""
        spec = self._specs.get(_OPTIMIZATION_LEVEL)
        if spec is None:
            problems.append(self._unknown("-O"))
            return i
        if token == "-O":
            if i < len(args) and args[i] in {"0", "1", "2", "3"}:
                value, i = args[i], i + 1
            else:
                problems.append(FlagProblem("-O", "needs a level: -O0 .. -O3 or -O<level>"))
                return i
        else:
            value = token[3:] if token[2] == "=" else token[2:]
        if problem := self._value_problem("-O", spec, value):
            problems.append(problem)
        return i

    @staticmethod
    def _switch_hint(spec: FlagSpec) -> str:
        if spec.negations:
            return f"use {spec.name} or {spec.negations[-1]}"
        return f"use {spec.name} (it has no negation)"

    @staticmethod
    def _take_values(spec: FlagSpec, args: list[str], i: int) -> tuple[list[str], int]:
        """Consume the values argparse would give the flag (greedy for + and *)."""
        want = spec.nargs
        limit = want if isinstance(want, int) else (1 if want in (None, "?") else len(args))
        values: list[str] = []
        while len(values) < limit and i < len(args) and not _looks_like_flag(args[i]):
            values.append(args[i])
            i += 1
        return values, i

    @staticmethod
    def _count_problems(flag: str, spec: FlagSpec, values: list[str]) -> list[FlagProblem]:
        want = spec.nargs
        if want in ("?", "*"):
            return []
        need = want if isinstance(want, int) else 1
        if want == "+" and values:
            return []
        if len(values) == need:
            return []
        if not values:
            return [FlagProblem(flag, "expects a value" if need == 1 else f"expects {need} values")]
        return [FlagProblem(flag, f"expects {need} value(s), got {len(values)}")]

    # -- YAML config --------------------------------------------------------

    def check_config(self, mapping: Mapping[str, object]) -> list[FlagProblem]:
        """Check a vLLM ``--config`` YAML mapping (keys are flag names without dashes)."""
        problems: list[FlagProblem] = []
        for key, value in mapping.items():
            if not isinstance(key, str) or not key:
                problems.append(FlagProblem(repr(key), "config keys must be flag names"))
                continue
            if key.startswith("-"):
                problems.append(FlagProblem(
                    key, f"write config keys without dashes ({key.lstrip('-')})"))
                continue
            base, dot, _sub = key.partition(".")
            flag = _normalize("--" + base)
            if flag == "--config":
                problems.append(FlagProblem(flag, "vLLM ignores a config file inside another"))
                continue
            found = self._lookup.get(flag)
            if found is None:
                problems.append(self._unknown(flag))
                continue
            spec, negated = found
            if dot:
                if (dotted := _dotted_problem(flag, key, spec, negated)) is not None:
                    problems.append(dotted)
                continue
            problems.extend(self._config_value(key, flag, spec, negated, value))
        return problems

    def _config_value(
        self, key: str, flag: str, spec: FlagSpec, negated: bool, value: object
    ) -> list[FlagProblem]:
        """Check one YAML value the way vLLM turns it into arguments."""
        if isinstance(value, bool):
            if value:
                if spec.takes_value and spec.nargs not in ("?", "*"):
                    return [FlagProblem(flag, "true given, but the flag takes a value")]
                return []
            if not spec.takes_value and not negated and spec.negations:
                if "_" in key:  # vLLM looks up --no-<key> verbatim
                    return [FlagProblem(flag, f"vLLM silently ignores '{key}: false' "
                                        "(underscores); spell the key with dashes")]
                return []
            if not spec.takes_value and not negated:
                return []  # a plain store_true: false is the default anyway
            return [FlagProblem(flag, "vLLM silently ignores false here; "
                                + ("use the positive flag" if negated else "give a value"))]
        if not spec.takes_value:
            return [FlagProblem(flag, "is a boolean switch: use true or false")]
        if isinstance(value, dict):
            if spec.takes_json:
                return self.config_problems(flag, spec, value)
            return [FlagProblem(flag, "a mapping becomes JSON, but the flag does not take JSON")]
        if isinstance(value, (list, tuple)):
            values = [str(v) for v in value]
            if not values:
                return []
            if len(values) > 1 and not (spec.nargs in ("+", "*") or spec.nargs == len(values)):
                return [FlagProblem(flag, f"takes one value, got a list of {len(values)}")]
        else:
            values = [str(value)]
        problems = self._count_problems(flag, spec, values)
        problems.extend(p for v in values if (p := self._value_problem(flag, spec, v)))
        return problems


def _read_json(name: str) -> Any:
    path = resources.files("gpufleet") / "data" / "vllm_catalogs" / name
    return json.loads(path.read_text(encoding="utf-8"))


@functools.cache
def _removed_flags() -> dict[str, RemovedFlag]:
    return {
        flag: RemovedFlag(flag, entry["replacement"], entry.get("reason", "removed from vLLM"))
        for flag, entry in _read_json("removed.json").items()
    }


@functools.cache
def load_catalog(version: str = DEFAULT_VLLM_VERSION) -> FlagCatalog:
    """The flag catalog of a supported vLLM version (cached)."""
    if version not in SUPPORTED_VLLM_VERSIONS:
        raise UnsupportedVersionError(
            f"no vLLM flag catalog for version {version!r}; "
            f"supported: {', '.join(SUPPORTED_VLLM_VERSIONS)}"
        )
    data = _read_json(f"vllm-{version}.json")
    specs = [FlagSpec.from_json(entry) for entry in data["options"]]
    return FlagCatalog(data["vllm_version"], specs, _removed_flags(), data.get("config_classes"))
