"""Where a task's files live on a worker (docs/workspaces.md).

    <home>/tasks/<job>.<task>/                BERTH_TASK_DIR: the working directory, kept
                                              across the task's attempts on this worker
    <home>/tasks/<job>.<task>.bundle          the digest unpacked there last
    <home>/scratch/<job>.<task>.<attempt>/    BERTH_SCRATCH_DIR: this attempt's own,
                                              removed when it ends

No directory per job: a directory's creation is the dearest file-system call an attempt
makes (docs/performance.md), and a job id has no dot, so the entries of a job are those
named `<job>.`. A resumed or retried attempt finds what the earlier ones left in
BERTH_TASK_DIR (a checkpoint). A job's entries are removed once no attempt has used them
for BERTH_TASK_DIR_MAX_AGE (its last use: its newest entry's mtime), and above
BERTH_TASK_DIR_MAX_MB the least recently used jobs' go first. The layout before 2026-11-29
(`tasks/<job>/<task>/`) is moved to this one when the agent starts (`move_old_layout`).
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
        tasks = home / "tasks"
        return cls(task=tasks / f"{job_id}.{task_index}",
                   scratch=home / "scratch" / f"{job_id}.{task_index}.{attempt_id}",
                   bundle_marker=tasks / f"{job_id}.{task_index}.bundle")

    def create(self) -> None:
        """Both directories, and the task's marked used now (its mtime, for the age-based
        clean-up). One `mkdir` each once `tasks/` and `scratch/` are there (pathlib's
        `mkdir(parents=True)` was most of an attempt's start in the agent's profile)."""
        task_existed = False
        for path in (self.task, self.scratch):
            try:
                os.mkdir(path)
            except FileExistsError:
                task_existed = task_existed or path is self.task
            except FileNotFoundError:  # the worker's first attempt: `tasks/` or `scratch/`
                path.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path)
        if task_existed:  # else its creation has marked it
            with contextlib.suppress(OSError):
                os.utime(self.task)

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
    last_used: float  # the newest mtime of its entries in <home>/tasks
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


def job_of(entry_name: str) -> str:
    """The job an entry of `tasks/` or `scratch/` belongs to (a job id has no dot)."""
    return entry_name.split(".", 1)[0]


def job_dirs(home: Path, sizes: bool) -> list[JobDir]:
    """Each job with entries in `tasks/`: when it was last used and what it holds."""
    used: dict[str, float] = {}
    held: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(home / "tasks"):
            with contextlib.suppress(OSError):
                job = job_of(entry.name)
                stat = entry.stat(follow_symlinks=False)
                used[job] = max(used.get(job, 0.0), stat.st_mtime)
                if sizes:
                    held[job] = held.get(job, 0) + (
                        _size(Path(entry.path)) if entry.is_dir(follow_symlinks=False)
                        else stat.st_size)
    return [JobDir(job, last, held.get(job, 0)) for job, last in used.items()]


def _remove_entries(where: Path, jobs: set[str]) -> None:
    with contextlib.suppress(OSError):
        for entry in os.scandir(where):
            if job_of(entry.name) in jobs:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)


def remove_stale(home: Path, max_age: float, max_bytes: int, in_use: Iterable[str]) -> list[str]:
    """Removes what `to_remove` picks: the jobs' task directories and bundle marks, and
    their scratch left by an attempt whose agent died before it could remove it (either
    layout); returns the job ids."""
    names = to_remove(job_dirs(home, sizes=bool(max_bytes)), max_age, max_bytes, set(in_use),
                      time.time())
    gone = set(names)
    if gone:
        _remove_entries(home / "tasks", gone)
        _remove_entries(home / "scratch", gone)
    return names


def move_old_layout(home: Path) -> int:
    """Moves task directories of the layout before 2026-11-29 (`tasks/<job>/<task>/`, with
    `tasks/<job>/<task>.bundle`) to this one, each keeping its job's last use, so that a
    resumed attempt finds its checkpoint. Called when the agent starts, before any attempt
    (the last incarnation's are killed first). Returns how many it moved. One whose new
    place is taken already stays where it was, and goes with its job's age."""
    moved = 0
    with contextlib.suppress(OSError):
        for job_dir in os.scandir(home / "tasks"):
            if "." in job_dir.name or not job_dir.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError):
                last_used = job_dir.stat(follow_symlinks=False).st_mtime
                for entry in os.scandir(job_dir.path):
                    target = home / "tasks" / f"{job_dir.name}.{entry.name}"
                    if os.path.lexists(target):
                        continue
                    os.rename(entry.path, target)
                    os.utime(target, (last_used, last_used), follow_symlinks=False)
                    moved += 1
                os.rmdir(job_dir.path)
    return moved
