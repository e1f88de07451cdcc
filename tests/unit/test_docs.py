"""The docs: the reference pages are what ``make docs`` writes, every variable is set once and documented, the
supported vLLM versions have one home, and the README stays a short read whose links all lead somewhere."""

from __future__ import annotations

import difflib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from gpufleet_lab.wheelhouse import LAB_VLLM_VERSIONS

from gpufleet.config.schema import SCHEMA_KEYS
from gpufleet.config.vllm_flags import DEFAULT_VLLM_VERSION, SUPPORTED_VLLM_VERSIONS
from tests.conftest import ROOT

README_MAX_LINES = 200
README_COMMANDS = ["make lab", "make test"]  # the fresh machine's two commands; CI runs the second (.ci/run)
MARKDOWN = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_VERSION = re.compile(r"\b\d+\.\d+\.\d+\b")


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_docs"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


GEN = _load_generator()


@pytest.fixture(scope="module")
def pages() -> dict[Path, str]:
    return GEN.pages(ROOT)  # type: ignore[no-any-return]


# --- the reference pages are generated -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(GEN.PAGES))
def test_reference_page_is_what_make_docs_writes(pages: dict[Path, str], name: str) -> None:
    path = GEN.REFERENCE / name
    committed = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
    diff = list(difflib.unified_diff(committed.splitlines(), pages[path].splitlines(), "committed", "generated",
                                     lineterm="", n=1))
    assert not diff, (f"{path} is stale: regenerate it with `make docs` ({GEN.REGENERATE}) and commit it; the first"
                      " differences:\n" + "\n".join(diff[:20]))


def test_a_changed_comment_makes_the_page_stale(tmp_path: Path) -> None:
    """The staleness check sees a defaults.yml edit that the committed page lacks."""
    for role in ("fleet", "vllm"):
        (tmp_path / "roles" / role).mkdir(parents=True)
        (tmp_path / "roles" / role / "defaults.yml").write_text((ROOT / "roles" / role / "defaults.yml").read_text())
    written = GEN.variables_page(tmp_path)
    defaults = tmp_path / "roles" / "vllm" / "defaults.yml"
    defaults.write_text(defaults.read_text().replace("# Name clients use in requests", "# The name clients use"))
    assert GEN.variables_page(tmp_path) != written
    assert "The name clients use" in GEN.variables_page(tmp_path)


# --- roles/*/defaults.yml and the schema ---------------------------------------------------------------------------

def test_the_roles_defaults_set_every_schema_field_once() -> None:
    roles_of: dict[str, list[str]] = {}
    for role in GEN.all_defaults(ROOT):
        for variable in role.variables:
            roles_of.setdefault(variable.name, []).append(role.role)
    assert {name: roles for name, roles in roles_of.items() if len(roles) > 1} == {}
    assert sorted(set(roles_of) - SCHEMA_KEYS) == [], "in a defaults.yml but not in HostConfig"
    assert sorted(SCHEMA_KEYS - set(roles_of)) == [], "in HostConfig but in no defaults.yml"


@pytest.mark.parametrize("path", sorted((ROOT / "roles").glob("*/defaults.yml")), ids=lambda p: p.parent.name)
def test_the_generator_reads_the_keys_yaml_reads(path: Path) -> None:
    assert [v.name for v in GEN.read_defaults(path).variables] == list(yaml.safe_load(path.read_text()) or {})


def test_every_variable_is_documented(pages: dict[Path, str]) -> None:
    """Each variable has a comment in its defaults.yml, and the variables reference has an entry for every field."""
    assert [v.name for role in GEN.all_defaults(ROOT) for v in role.variables if not v.comment] == []
    entries = re.findall(r"^#### `([a-z][a-z0-9_]*)`$", pages[GEN.REFERENCE / "variables.md"], re.M)
    assert sorted(entries) == sorted(SCHEMA_KEYS)


def test_comments_belong_to_the_keys_below_them(tmp_path: Path) -> None:
    path = tmp_path / "roles" / "demo" / "defaults.yml"
    path.parent.mkdir(parents=True)
    path.write_text("# The demo role.\n\n# --- Ports ---\n# Its port and its twin's.\nport: 1\ntwin: 2\n"
                    "# Off by default.\n#   indented: kept as code\nflag: false\n")
    demo = GEN.read_defaults(path)
    assert demo.header == ("The demo role.",)
    port, twin, flag = demo.variables
    assert port.comment == twin.comment == ("Its port and its twin's.",) and twin.section == "Ports"
    assert flag.default == "false"
    assert GEN.comment_markdown(flag.comment) == "Off by default.\n\n```\nindented: kept as code\n```"
    path.write_text("port: 1\n\n# A comment no key follows.\n\nflag: false\n")
    with pytest.raises(ValueError, match="belongs to no variable"):
        GEN.read_defaults(path)


def test_types_come_from_the_schema() -> None:
    text, words = GEN.field_type("vllm_port")
    assert (text, words.rules) == ("integer, 1 ≤ x ≤ 65535", [
        "At least 1024: gpufleet's services run without the capability to bind a lower port."])
    assert GEN.field_type("vllm_tensor_parallel_size")[0] == "integer, 1 ≤ x ≤ 1024, or `auto`"
    assert GEN.field_type("fleet_interface")[1].rules[0].startswith("A network interface name")
    assert "SecretRef" in GEN.field_type("vllm_api_key")[1].mappings
    with pytest.raises(ValueError, match="no words for the type"):
        GEN.describe_type(complex, GEN.Words())


# --- the supported vLLM versions: SUPPORTED_VLLM_VERSIONS ----------------------------------------------------------

def test_the_supported_vllm_versions_have_one_home() -> None:
    supported = list(SUPPORTED_VLLM_VERSIONS)
    assert GEN.field_type("vllm_version")[0] == "one of " + ", ".join(f"`{v}`" for v in supported)
    catalogs = sorted(p.name for p in (ROOT / "gpufleet" / "data" / "vllm_catalogs").glob("vllm-*.json"))
    assert catalogs == sorted(f"vllm-{v}.json" for v in supported)
    make_catalogs = re.search(r"gen_vllm_catalog\.py (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert make_catalogs is not None and make_catalogs.group(1).split() == supported
    assert set(LAB_VLLM_VERSIONS) <= set(supported)
    (vllm_version,) = [v for role in GEN.all_defaults(ROOT) for v in role.variables if v.name == "vllm_version"]
    assert yaml.safe_load(vllm_version.default) == DEFAULT_VLLM_VERSION in supported
    assert _VERSION.findall(" ".join(vllm_version.comment)) == [], "the choices live in SUPPORTED_VLLM_VERSIONS"


# --- the README and the links ---------------------------------------------------------------------------------------

def test_the_readme_is_short_and_starts_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    first_block = re.search(r"^```sh\n(.*?)^```", text, re.M | re.S)
    assert first_block is not None and text.index(first_block.group(0)) < text.index("\n## ")
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == README_COMMANDS
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings (headings in code blocks are none)."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", _FENCE.sub("", text), re.M):
        slug = GEN.slug(heading)
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_leads_somewhere(page: Path) -> None:
    text = _FENCE.sub("", page.read_text())
    broken = []
    for target in _LINK.findall(re.sub(r"`[^`]*`", "", text)):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists() or (anchor and (path.is_dir() or anchor not in _anchors(path.read_text()))):
            broken.append(target)
    assert broken == []


def test_every_make_target_the_docs_name_exists() -> None:
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    named = {name for page in MARKDOWN for name in re.findall(r"(?:`|^)make ([a-z][a-z-]*)", page.read_text(), re.M)}
    assert "docs" in named and sorted(named - targets) == []
