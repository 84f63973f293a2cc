"""One namespace (issue 17 item 6): the folders `shared/` and `services/` are installed and
imported only as `berth.shared` and `berth.services` (docs/decisions.md, "One namespace").
In this checkout the old top-level names still import (pytest puts the repository first on
sys.path), so a leftover `from shared...` would pass every test here and fail only once
installed; this finds one before that. And `in_a_poisoned_project`, which a real-stack test
imports to run from a directory whose `shared/`, `services/` and `berth/` must never be
imported."""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OLD = ("shared", "services")
# A module path in a string: a `python -m` target, a logger name, a mock.patch target.
OLD_DOTTED = re.compile(r"(?:shared|services)(?:\.\w+)+")
# An import in code that a string holds (`python -c`).
OLD_FROM = re.compile(r"(?<![\w.])from ((?:shared|services)(?:\.\w+)*) import\b")
# What may be one of the above, to parse only the files that hold it (parsing all is ~1 s).
SUSPECT = re.compile(r"(?:from|import)\s+(?:shared|services)\b|[\"'](?:shared|services)\.")


@pytest.fixture(autouse=True)
def in_a_poisoned_project(tmp_path_factory: pytest.TempPathFactory,
                          monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The working directory is a user's project whose folders have the names of berth's
    packages, each raising on import. Autouse: a module that imports this fixture runs all
    of its tests from there, so every process they start inherits that directory (the
    `berth` command and its services start with `python -P`, which keeps it off sys.path)."""
    where = tmp_path_factory.mktemp("project")
    for name in ("shared", "services", "berth"):
        (where / name).mkdir()
        (where / name / "__init__.py").write_text(
            f"raise SystemExit('the working directory\\'s {name}/ was imported')\n")
    monkeypatch.chdir(where)
    yield where


def _python_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.py"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / name for name in listed.split() if not (ROOT / name).is_symlink()]


def _old_names(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = ([node.value] if OLD_DOTTED.fullmatch(node.value)
                     else OLD_FROM.findall(node.value))
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in OLD]
    return found


def test_nothing_imports_shared_or_services_outside_the_berth_namespace() -> None:
    s, v = OLD  # spelled apart, so that the rewrite script leaves this sample alone
    planted = (f"from {s}.x import y\nimport {v}.a\nz = '{s}.config.X'\nq = '{s}.'\n"
               f"c = 'import sys; from {s} import dir_lock'\n")
    assert SUSPECT.search(planted)
    assert [name for _, name in _old_names(ast.parse(planted))] == [
        f"{s}.x", f"{v}.a", f"{s}.config.X", s]
    files = _python_files()
    assert any(p.relative_to(ROOT).parts[0] == "shared" for p in files)
    sources = {p: p.read_text() for p in files}
    left = [f"{p.relative_to(ROOT)}:{line}: {name}" for p, text in sources.items()
            if SUSPECT.search(text) for line, name in _old_names(ast.parse(text))]
    assert left == [], "old top-level names (tools_rewrite_namespace.py rewrites them):\n" + \
        "\n".join(left)


def test_the_namespace_is_two_links_to_the_folders_of_the_design() -> None:
    for top in OLD:
        link = ROOT / "berth" / top
        assert link.is_symlink() and link.resolve() == ROOT / top, link
    assert (ROOT / "berth" / "py.typed").exists()
