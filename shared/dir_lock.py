"""One owner per piece of a data dir: an exclusive `flock` on a lock file holding the
owner's pid. The kernel drops the lock when its process ends, however it ends, so a crash
never leaves a stale lock behind; the pid in the file is only there to name the holder.

`berth up` locks `<data_dir>/stack.lock` before it starts anything (the NATS and Redis
stores, the services and the local workers all live under it); a dashboard locks
`<data_dir>/dashboard.lock` (its snapshot and durable consumer); a worker locks
`<data_dir>/worker-<id>.lock` (its task homes, and the orphans it kills on start).

The stack's lock is inherited by every process `berth up` starts (`inherited_fds`), so it
is held while any of them lives: a `berth up` killed with SIGKILL leaves its NATS and Redis
running on the data dir, and a second `berth up` must still be refused."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class DirLocked(Exception):
    """Another live process holds the lock; the message is one line naming it."""


# Locks whose descriptor the processes started from here inherit.
_inherited: list[int] = []


def inherited_fds() -> tuple[int, ...]:
    """Descriptors to pass to child processes (subprocess's `pass_fds`)."""
    return tuple(_inherited)


class DirLock:
    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    def release(self) -> None:
        """Closes this process's descriptor; the lock is free once no process started
        with it (inherit=True) still holds a copy."""
        if self._fd >= 0:
            if self._fd in _inherited:
                _inherited.remove(self._fd)
            os.close(self._fd)
            self._fd = -1


def acquire(path: Path, what: str, inherit: bool = False) -> DirLock:
    """Takes the exclusive lock at `path` for `what` ("berth up", "worker local-0"), or
    raises DirLocked naming the holder's pid. Keep the returned lock for the process's
    life (or release it). `inherit`: child processes started afterwards hold it too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise DirLocked(f"{path.parent} is in use: {path.name} is held by {holder}; "
                        f"refusing to start {what} on the same data dir") from None
    except OSError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {what}\n".encode(), 0)
    if inherit:
        _inherited.append(fd)
    return DirLock(path, fd)


def _read_holder(fd: int) -> str:
    try:
        raw = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        raw = ""
    pid, _, what = raw.partition(" ")
    if not pid.isdigit():
        return "another process"
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return f"a process started by {what or 'a process'} (pid {pid}, now gone)"
    except OSError:
        pass
    return f"{what or 'a process'} (pid {pid})"
