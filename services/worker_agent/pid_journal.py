"""The process groups this worker's attempts lead, kept where a restarted agent finds them.

Each attempt's supervisor leads a process group and kills its tree when the agent goes (its
stdin closes). One that cannot (paused, or stuck) would leave its task running beside the
retry the scheduler makes, so a restarted agent kills every group an earlier incarnation
left behind. The groups are kept in one append-only journal: a line when an attempt's
supervisor has started (`+ PGID KEY`), one when it is done (`- KEY`), each a single write
to a file kept open. A file per attempt, created and then removed, cost 0.4-0.6 ms of CPU
per attempt on a test machine's file system, on the way to the attempt's RUNNING report
(docs/performance.md). Once the journal holds COMPACT_AFTER lines it is rewritten with the
live groups alone.

An agent that dies leaves its last lines in the page cache, so the next incarnation reads
them; a line torn by a machine's crash (whose tasks died with it) is skipped.
"""

from __future__ import annotations

import os
from pathlib import Path

COMPACT_AFTER = 10_000


def read(path: Path) -> dict[str, int]:
    """The groups a journal lists as live: each started attempt's, unless it is done."""
    live: dict[str, int] = {}
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return live
    for line in text.splitlines():
        match line.split(" ", 2):
            case ["+", pgid, key] if pgid.isdigit() and int(pgid) > 1:
                live[key] = int(pgid)
            case ["-", key]:
                live.pop(key, None)
    return live


class PidJournal:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.live: dict[str, int] = {}
        self._fd = -1
        self._lines = 0

    def open(self) -> None:
        """Starts an empty journal, over the last one: `read` it first, and kill what it
        lists, so that a crash in between forgets nothing."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._rewrite()

    def started(self, key: str, pgid: int) -> None:
        self.live[key] = pgid
        self._append(f"+ {pgid} {key}\n")

    def ended(self, key: str) -> None:
        if self.live.pop(key, None) is not None:
            self._append(f"- {key}\n")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _append(self, line: str) -> None:
        if self._fd < 0:
            return  # not opened: a simulated host runs no process to leave behind
        os.write(self._fd, line.encode())
        self._lines += 1
        if self._lines >= COMPACT_AFTER:
            self._rewrite()

    def _rewrite(self) -> None:
        # A new file put in place at once: a reader sees the old journal or the new one.
        fresh = self.path.with_name(self.path.name + ".new")
        with open(fresh, "w") as f:
            f.writelines(f"+ {pgid} {key}\n" for key, pgid in self.live.items())
        os.replace(fresh, self.path)
        self.close()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._lines = len(self.live)
