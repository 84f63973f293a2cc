"""find_program (services/worker_agent/process.py): a PATH search remembered while its answer
stays executable, the check before an attempt starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from berth.services.worker_agent import process
from berth.services.worker_agent.process import find_program


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


@pytest.fixture(autouse=True)
def _forget() -> None:
    process._found.clear()


def test_the_answer_is_whichs_and_is_remembered(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    tool = _executable(b / "tool")
    path = f"{a}{os.pathsep}{b}"
    assert find_program("tool", path) == str(tool)
    searches = []
    monkeypatch.setattr(process.shutil, "which",
                        lambda *args, **kw: searches.append(args) or None)
    assert find_program("tool", path) == str(tool)
    assert searches == []  # remembered: no search


def test_a_remembered_program_that_is_gone_is_looked_for_again(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    first = _executable(a / "tool")
    second = _executable(b / "tool")
    path = f"{a}{os.pathsep}{b}"
    assert find_program("tool", path) == str(first)
    first.unlink()
    assert find_program("tool", path) == str(second)
    second.chmod(0o644)  # no longer executable
    assert find_program("tool", path) is None
    assert ("tool", path) not in process._found


def test_each_path_has_its_own_answer(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    in_a, in_b = _executable(a / "tool"), _executable(b / "tool")
    assert find_program("tool", str(a)) == str(in_a)
    assert find_program("tool", str(b)) == str(in_b)
    assert find_program("missing", str(a)) is None


def test_what_is_remembered_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "MAX_FOUND", 4)
    _executable(tmp_path / "tool")
    for i in range(10):
        assert find_program("tool", f"{tmp_path}{os.pathsep}/nonexistent{i}")
        assert len(process._found) <= 4
