"""Where a task's files live on a worker (docs/workspaces.md).

    <home>/tasks/<job>/<task>/                BERTH_TASK_DIR: the working directory, kept
                                              across the task's attempts on this worker
    <home>/tasks/<job>/<task>.bundle          the digest unpacked there last
    <home>/scratch/<job>/<task>/<attempt>/    BERTH_SCRATCH_DIR: this attempt's own,
                                              removed when it ends

A resumed or retried attempt finds what the earlier ones left in BERTH_TASK_DIR (a
checkpoint). Job directories no attempt has used for BERTH_TASK_DIR_MAX_AGE are removed.
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
                   scratch=home / "scratch" / job_id / str(task_index) / str(attempt_id),
                   bundle_marker=tasks / f"{task_index}.bundle")

    def create(self) -> None:
        self.task.mkdir(parents=True, exist_ok=True)
        self.scratch.mkdir(parents=True, exist_ok=True)
        # Marks the job's directory used now, for the age-based clean-up.
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

    def remove_scratch(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def stale_jobs(home: Path, max_age: float, in_use: Iterable[str],
               now: float | None = None) -> list[Path]:
    """Job directories under `home/tasks` untouched for `max_age` seconds and with no
    attempt running here."""
    now = time.time() if now is None else now
    keep = set(in_use)
    out = []
    with contextlib.suppress(OSError):
        for job_dir in (home / "tasks").iterdir():
            with contextlib.suppress(OSError):
                if job_dir.name not in keep and now - job_dir.stat().st_mtime > max_age:
                    out.append(job_dir)
    return sorted(out)


def remove_stale(home: Path, max_age: float, in_use: Iterable[str]) -> list[str]:
    removed = []
    for job_dir in stale_jobs(home, max_age, list(in_use)):
        shutil.rmtree(job_dir, ignore_errors=True)
        shutil.rmtree(home / "scratch" / job_dir.name, ignore_errors=True)
        removed.append(job_dir.name)
    return removed
