"""The files of ``group_vars/``: each one read, or named as the reason it is not.

gpufleet reads ``group_vars/all.yml`` and ``group_vars/<group>.yml`` for the inventory's groups. A ``.yaml`` file
would be skipped, and so would a file for a group no inventory has (a typo of the group's name): both are
refused. One ``group_vars/`` may serve several inventory files beside one another, so a file is for a group when
this inventory file or one beside it binds that name (a group the file defines only sometimes, as the lab's pipeline
pair, included).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from gpufleet.config.inventory_shape import SourceLines
from gpufleet.config.layers import display_path
from gpufleet.input_files import found_at
from gpufleet.values.problems import Problem


def _bound_names(inventory_file: Path) -> set[str]:
    """Names bound at module level by ``inventory_file`` (a group it defines only sometimes included) and by the
    inventory files beside it."""
    names: set[str] = set()
    for path in sorted(inventory_file.parent.glob("*.py")):
        names |= SourceLines(path).names()
    return names


def group_vars_file_problems(gv_dir: Path, inventory_file: Path, groups: list[str]) -> list[Problem]:
    """``group_vars`` that is not a directory; in it, anything but ``<group>.yml`` files (a ``.yaml`` file, another
    suffix, a directory), or a ``.yml`` file for a group neither this inventory nor one beside it has. Hidden files
    (an editor's, ``.gitkeep``) are left alone."""
    if not os.path.lexists(gv_dir):
        return []
    if not gv_dir.is_dir():
        return [Problem(display_path(gv_dir), "", "expected a directory of <group>.yml files, found"
                        f" {found_at(str(gv_dir))}")]
    problems: list[Problem] = []
    known = {"all", *groups}
    others: set[str] | None = None
    for path in sorted(gv_dir.iterdir()):
        if path.name.startswith("."):
            continue
        shown = display_path(path)
        if path.suffix == ".yaml":
            problems.append(Problem(shown, "", f"expected {path.stem}.yml (gpufleet reads group_vars/*.yml only),"
                                    " found a .yaml file"))
            continue
        if path.suffix != ".yml":  # a <group>.yml that is no file is named as such when it is read
            what = ("a directory (gpufleet reads no group_vars/<group>/ directory)" if path.is_dir()
                    else f"a {path.suffix} file" if path.suffix else "a file without .yml")
            problems.append(Problem(shown, "", f"expected <group>.yml files only in group_vars (gpufleet reads"
                                    f" nothing else there), found {what}"))
            continue
        if path.stem in known:
            continue
        if others is None:
            others = _bound_names(inventory_file)
        if path.stem in others:
            continue
        near = difflib.get_close_matches(path.stem, sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]}.yml?" if near else ""
        problems.append(Problem(shown, "", f"expected a file named after a group of {display_path(inventory_file)}"
                                f" ({', '.join(sorted(known))}), found no group {path.stem}{hint}"))
    return problems
