"""The worker's journal of its attempts' process groups (services/worker_agent/pid_journal.py)
and the restarted agent's clean-up from it, with real process groups."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from berth.services.worker_agent import pid_journal
from berth.services.worker_agent.pid_journal import PidJournal, read
from berth.services.worker_agent.service import WorkerAgent


def test_started_and_ended_attempts_replay_to_the_live_ones(tmp_path: Path) -> None:
    journal = PidJournal(tmp_path / "groups")
    journal.open()
    journal.started("j1-aaaa/0/1", 101)
    journal.started("j1-aaaa/1/1", 102)
    journal.started("j2-bbbb/0/3", 103)
    journal.ended("j1-aaaa/0/1")
    journal.ended("never/0/1")  # not started here: nothing written
    assert read(journal.path) == {"j1-aaaa/1/1": 102, "j2-bbbb/0/3": 103}
    assert journal.path.read_text().count("\n") == 4
    # The next incarnation reads what was left, then starts an empty journal over it.
    again = PidJournal(tmp_path / "groups")
    assert read(again.path) == {"j1-aaaa/1/1": 102, "j2-bbbb/0/3": 103}
    again.open()
    assert read(again.path) == {}


def test_a_long_journal_is_rewritten_with_the_live_groups_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pid_journal, "COMPACT_AFTER", 10)
    journal = PidJournal(tmp_path / "groups")
    journal.open()
    for i in range(2, 30):
        journal.started(f"k{i}", i)
        if i % 3:
            journal.ended(f"k{i}")
    expected = {f"k{i}": i for i in range(2, 30) if not i % 3}
    assert read(journal.path) == journal.live == expected
    assert journal.path.read_text().count("\n") < 10 + len(expected)
    journal.close()


def test_a_torn_or_foreign_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "groups"
    path.write_text("+ 55 a/0/1\n+ x b/0/1\n+ 1 init/0/1\n- \nnonsense\n+ 77 c/0/1\n+ 8")
    assert read(path) == {"a/0/1": 55, "c/0/1": 77}


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=60))
def test_the_journal_always_replays_to_what_is_live(steps: list[tuple[bool, int]]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        journal = PidJournal(Path(tmp) / "groups")
        journal.open()
        live: dict[str, int] = {}
        for start, n in steps:
            key = f"j/{n}/1"
            if start:
                journal.started(key, 100 + n)
                live[key] = 100 + n
            else:
                journal.ended(key)
                live.pop(key, None)
        assert read(journal.path) == live
        journal.close()


def test_a_restarted_agent_kills_the_groups_left_in_its_journal_and_old_pid_files(
        tmp_path: Path) -> None:
    groups = [subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(3)]
    try:
        before = PidJournal(tmp_path / "attempt-groups")
        before.open()
        before.started("j1-aaaa/0/1", groups[0].pid)
        before.started("j1-aaaa/1/1", groups[1].pid)
        before.ended("j1-aaaa/1/1")  # done: its group is not ours to kill any more
        before.close()
        (tmp_path / "pids").mkdir()
        (tmp_path / "pids" / "j2-bbbb_0_1").write_text(str(groups[2].pid))  # an older agent's
        agent = SimpleNamespace(pid_journal=PidJournal(tmp_path / "attempt-groups"),
                                pid_dir=tmp_path / "pids")
        WorkerAgent._kill_orphans(agent)  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while groups[0].poll() is None or groups[2].poll() is None:
            assert time.monotonic() < deadline, "the orphaned groups were not killed"
            time.sleep(0.02)
        assert groups[0].returncode == groups[2].returncode == -signal.SIGKILL
        assert groups[1].poll() is None
        assert list((tmp_path / "pids").iterdir()) == []
        assert read(tmp_path / "attempt-groups") == {}
    finally:
        for p in groups:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
