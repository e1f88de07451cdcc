"""The docs: the reference pages are what ``make docs`` writes, every variable is set once and documented, the
supported vLLM versions have one home, and the README stays a short read whose links all lead somewhere."""

from __future__ import annotations

import difflib
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from gpufleet_lab.wheelhouse import LAB_VLLM_VERSIONS

from gpufleet.config.schema import (
    GPUFLEET_ENV,
    OWNED_ENV,
    OWNED_FLAGS,
    RECORDS,
    SCHEMA_KEYS,
    SECRET_KEYS,
    SECRET_TREES,
    HostConfig,
)
from gpufleet.config.settings import Setting
from gpufleet.values.vllm_flags import DEFAULT_VLLM_VERSION, SUPPORTED_VLLM_VERSIONS
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

@pytest.mark.parametrize("path", sorted(GEN.pages(ROOT)), ids=str)
def test_each_written_file_is_what_make_docs_writes(pages: dict[Path, str], path: Path) -> None:
    """The reference pages and every role's defaults.yml."""
    committed = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
    diff = list(difflib.unified_diff(committed.splitlines(), pages[path].splitlines(), "committed", "generated",
                                     lineterm="", n=1))
    assert not diff, (f"{path} is stale: regenerate it with `make docs` ({GEN.REGENERATE}) and commit it; the first"
                      " differences:\n" + "\n".join(diff[:20]))


# --- a variable is one record --------------------------------------------------------------------------------------

def test_every_role_with_defaults_has_settings_and_every_variable_one_record() -> None:
    roles = GEN.role_settings()
    assert sorted(roles) == sorted(path.parent.name for path in (ROOT / "roles").glob("*/defaults.yml"))
    owners: dict[str, list[str]] = {}
    for role, model in roles.items():
        for name in model.model_fields:
            owners.setdefault(name, []).append(role)
    assert {name: found for name, found in owners.items() if len(found) > 1} == {}
    assert sorted(owners) == sorted(SCHEMA_KEYS)
    assert {name: RECORDS[name].role for name in RECORDS} == {name: found[0] for name, found in owners.items()}


@pytest.mark.parametrize("role", sorted(GEN.role_settings()))
def test_a_roles_defaults_are_its_records_defaults(role: str) -> None:
    """What the loader reads from roles/<role>/defaults.yml is each record's default, in the records' order."""
    read = yaml.safe_load((ROOT / "roles" / role / "defaults.yml").read_text())
    assert list(read) == [name for name, record in RECORDS.items() if record.role == role]
    assert read == {name: record.default for name, record in RECORDS.items() if record.role == role}


def test_every_variable_has_a_meaning_and_an_entry(pages: dict[Path, str]) -> None:
    assert [name for name, record in RECORDS.items() if not record.doc.strip()] == []
    entries = re.findall(r"^#### `([a-z][a-z0-9_]*)`$", pages[GEN.REFERENCE / "variables.md"], re.M)
    assert sorted(entries) == sorted(SCHEMA_KEYS)


def test_a_secret_is_typed_as_one_and_only_a_secret_is() -> None:
    """A record marked secret holds secret references (its type says so), and a variable typed as a secret
    reference is marked secret: the lists that hide values are derived from the marks."""
    typed = {name for name, field in HostConfig.model_fields.items() if "SecretRef" in repr(field.annotation)
             or "RouterClient" in repr(field.annotation)}
    assert typed == SECRET_KEYS | SECRET_TREES
    assert {name for name, record in RECORDS.items() if record.secret} == typed


def test_a_flag_or_variable_gpufleet_writes_is_claimed_by_one_record() -> None:
    """The owned flags and environment are derived from the records: two records never claim one, and the
    environment gpufleet sets from no variable is claimed by none."""
    flags = [flag for record in RECORDS.values() for flag in record.owned_flags]
    env = [name for record in RECORDS.values() for name in record.owned_env]
    assert sorted(flags) == sorted(set(flags)) and sorted(env) == sorted(set(env))
    assert set(env).isdisjoint(GPUFLEET_ENV)
    assert len(OWNED_FLAGS) == len(flags) and len(OWNED_ENV) == len(env) + len(GPUFLEET_ENV)


def test_a_roles_sections_are_each_one_run() -> None:
    demo = [Setting("a", "demo", 1, "A.", section="One"), Setting("b", "demo", 1, "B.", section="")]
    with pytest.raises(ValueError, match="b: expected its role's sections each in one run"):
        GEN.sectioned(demo)
    assert GEN.sectioned(demo[1:] + demo[:1]) == demo[1:] + demo[:1]


def test_a_record_is_written_as_its_role_file_says(tmp_path: Path) -> None:
    """Comment lines: prose wrapped to the width, a line that starts with a blank kept, a section heading."""
    assert GEN.doc_lines("word " * 40 + "end\n  kept:  as written") == (
        ("word " * 23).strip(), ("word " * 17).strip() + " end", "  kept:  as written")
    assert [GEN.yaml_value(v) for v in (None, "auto", "0.33.0", [1, 2], {}, False, 0.5)] == [
        "null", "auto", "0.33.0", "[1, 2]", "{}", "false", "0.5"]
    text = GEN.defaults_file("monitoring", GEN.role_settings()["monitoring"])
    assert text.startswith("# Written by `make docs` from gpufleet/config/settings/monitoring.py")
    assert "\n# --- GPU ---" in text and max(len(line) for line in text.splitlines() if line.startswith("#")) <= 118


def test_a_new_variable_is_one_record_and_make_docs_writes_the_rest(tmp_path: Path) -> None:
    """In a copy of the tree: a record added to a role's settings makes the check fail, naming its defaults.yml and
    the reference, until `make docs` writes them; then both hold it."""
    for part in ("gpufleet", "scripts", "roles", "docs"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    settings = tmp_path / "gpufleet" / "config" / "settings" / "monitoring.py"
    text = settings.read_text()
    anchor = "    alert_unit_restarts_max:"
    record = ('    alert_demo_for_s: Annotated[int, Field(ge=1, le=60)] = setting(\n'
              '        7, "Seconds of a demo alert, added as one record.", section="Node",\n    )\n\n')
    settings.write_text(text.replace(anchor, record + anchor, 1))

    def generate(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "scripts/gen_docs.py", *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, check=False)

    stale = generate("--check")
    assert stale.returncode == 1, stale.stderr
    assert sorted(re.findall(r"^(\S+) is stale", stale.stderr, re.M)) == [
        "docs/reference/variables.md", "roles/monitoring/defaults.yml"]
    assert generate().returncode == 0
    assert generate("--check").returncode == 0
    defaults = yaml.safe_load((tmp_path / "roles" / "monitoring" / "defaults.yml").read_text())
    assert defaults["alert_demo_for_s"] == 7
    page = (tmp_path / "docs" / "reference" / "variables.md").read_text()
    assert "#### `alert_demo_for_s`\n\n- type: integer, 1 ≤ x ≤ 60\n" in page
    assert "Seconds of a demo alert, added as one record." in page


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
    vllm_version = RECORDS["vllm_version"]
    assert vllm_version.default == DEFAULT_VLLM_VERSION in supported
    assert _VERSION.findall(vllm_version.doc) == [], "the choices live in SUPPORTED_VLLM_VERSIONS"


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
