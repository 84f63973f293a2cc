"""Where a task's files live on a worker (docs/workspaces.md).

    <home>/tasks/<job>/<task>/                BERTH_TASK_DIR: the working directory, kept
                                              across the task's attempts on this worker
    <home>/tasks/<job>/<task>.bundle          the digest unpacked there last
    <home>/scratch/<job>.<task>.<attempt>/    BERTH_SCRATCH_DIR: this attempt's own,
                                              removed when it ends

A resumed or retried attempt finds what the earlier ones left in BERTH_TASK_DIR (a
checkpoint). Job directories no attempt has used for BERTH_TASK_DIR_MAX_AGE are removed, and
above BERTH_TASK_DIR_MAX_MB the least recently used go first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TaskDirs:
    task: Path
    scratch: Path
    bundle_marker: Path

    @classmethod
    def of(cls, home: Path, job_id: str, task_index: int, attempt_id: int) -> TaskDirs:
        tasks = home / "tasks" / job_id
        return cls(task=tasks / str(task_index),
                   # No level per job: a directory's creation is the dearest file-system
                   # call an attempt makes (docs/performance.md). A job id has no dot.
                   scratch=home / "scratch" / f"{job_id}.{task_index}.{attempt_id}",
                   bundle_marker=tasks / f"{task_index}.bundle")

    def create(self) -> None:
        """Both directories, and the job's directory marked used now (its mtime, for the
        age-based clean-up). One `mkdir` each when their parents are there (pathlib's
        `mkdir(parents=True)` was most of an attempt's start in the agent's profile)."""
        task_existed = False
        for path in (self.task, self.scratch):
            try:
                os.mkdir(path)
            except FileExistsError:
                task_existed = task_existed or path is self.task
            except FileNotFoundError:  # the job's first task here: its directory too
                path.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path)
        if task_existed:  # else the task directory just made in it has marked it
            with contextlib.suppress(OSError):
                os.utime(self.task.parent)

    def env(self) -> dict[str, str]:
        return {"BERTH_TASK_DIR": str(self.task), "BERTH_SCRATCH_DIR": str(self.scratch)}

    def unpacked(self) -> str:
        """The digest of the bundle last unpacked in the task directory, or ""."""
        try:
            return self.bundle_marker.read_text().strip()
        except OSError:
            return ""

    def mark_unpacked(self, digest: str) -> None:
        self.bundle_marker.write_text(digest + "\n")

    def remove_scratch_if_empty(self) -> bool:
        """Removes the scratch directory if the attempt left nothing in it (most leave
        nothing): one system call, not worth a thread. False if it still holds files."""
        try:
            os.rmdir(self.scratch)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True

    def remove_scratch(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


@dataclass(frozen=True)
class JobDir:
    name: str
    last_used: float  # mtime of <home>/tasks/<job>
    size: int  # bytes of its task directories


def to_remove(jobs: list[JobDir], max_age: float, max_bytes: int, in_use: set[str],
              now: float) -> list[str]:
    """Which job directories go: every one unused for `max_age`, then the least recently
    used until the rest fit in `max_bytes` (0: no size cap). A job with an attempt running
    here always stays."""
    gone = [j for j in jobs if j.name not in in_use and now - j.last_used > max_age]
    kept = sorted((j for j in jobs if j not in gone), key=lambda j: j.last_used)
    total = sum(j.size for j in kept)
    if max_bytes:
        for job in kept:
            if total <= max_bytes:
                break
            if job.name not in in_use:
                gone.append(job)
                total -= job.size
    return sorted(j.name for j in gone)


def _size(path: Path) -> int:
    """The bytes a directory holds, a hard-linked file's size shared among its links: a
    bundled file linked from the cache into many task directories is not counted in full
    for each (bundle_trees.py)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(root, name))
                total += st.st_size // max(1, st.st_nlink)
    return total


def job_dirs(home: Path, sizes: bool) -> list[JobDir]:
    out = []
    with contextlib.suppress(OSError):
        for job_dir in (home / "tasks").iterdir():
            with contextlib.suppress(OSError):
                out.append(JobDir(job_dir.name, job_dir.stat().st_mtime,
                                  _size(job_dir) if sizes else 0))
    return out


def remove_stale(home: Path, max_age: float, max_bytes: int, in_use: Iterable[str]) -> list[str]:
    """Removes what `to_remove` picks (task and scratch directories); returns the job ids."""
    names = to_remove(job_dirs(home, sizes=bool(max_bytes)), max_age, max_bytes, set(in_use),
                      time.time())
    for name in names:
        shutil.rmtree(home / "tasks" / name, ignore_errors=True)
    gone = set(names)
    with contextlib.suppress(OSError):
        # Left by an attempt whose agent died before it could remove them; `scratch/<job>/`
        # is the layout before 2026-11-29.
        for entry in os.scandir(home / "scratch"):
            if entry.name.split(".", 1)[0] in gone:
                shutil.rmtree(entry.path, ignore_errors=True)
    return names
