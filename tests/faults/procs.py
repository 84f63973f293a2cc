"""Which task processes are alive, read from /proc: tasks carry a token in their argv (one
tag per run) and berth's task variables in their environment, so a sampler can tell which
attempt of which task runs on which worker, see two live copies of one task, and count what
outlived a stack."""

from __future__ import annotations

import os
import threading
import time

SAMPLE_EVERY = 0.1


def tagged(tag: str) -> list[tuple[int, list[bytes]]]:
    """Every process (pid, argv) with an argument starting with `tag`, zombies excepted."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if not any(a.startswith(tag.encode()) for a in argv):
                continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
        except OSError:
            continue
        found.append((int(entry), argv))
    return found


def sample(tag: str) -> list[tuple[str, str, str]]:
    """(token, worker id, attempt id) of every live task process carrying `tag` (its
    supervisor, which carries the task's argv too, is not the task)."""
    found = []
    for pid, argv in tagged(tag):
        if any(b"supervise" in a for a in argv):
            continue
        token = next(a.decode() for a in argv if a.startswith(tag.encode()))
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"BERTH_ATTEMPT_ID" not in env:
            # Every attempt's task has it: a process without it was read mid-exec (seen for
            # one sample at a task's start on the test bed), and is no second copy.
            continue
        found.append((token, env.get(b"BERTH_WORKER_ID", b"?").decode(),
                      env[b"BERTH_ATTEMPT_ID"].decode()))
    return found


class Sampler:
    """Which attempt of which task is alive where, every SAMPLE_EVERY seconds."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        # (token, worker, attempt) -> [first seen, last seen] (monotonic)
        self.seen: dict[tuple[str, str, str], list[float]] = {}
        self.overlap: dict[str, list[float]] = {}  # token -> monotonic times of overlap
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> Sampler:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.halt.set()
        self.thread.join()

    def _loop(self) -> None:
        while not self.halt.is_set():
            now = time.monotonic()
            alive: dict[str, set[tuple[str, str]]] = {}
            for token, worker, attempt in self.sample():
                alive.setdefault(token, set()).add((worker, attempt))
                self.seen.setdefault((token, worker, attempt), [now, now])[1] = now
            for token, copies in alive.items():
                if len({a for _, a in copies}) > 1:
                    self.overlap.setdefault(token, []).append(now)
            self.halt.wait(SAMPLE_EVERY)

    def sample(self) -> list[tuple[str, str, str]]:
        return sample(self.tag)

    def longest_overlap(self) -> float:
        """The longest run of consecutive overlapping samples, in seconds."""
        best = 0.0
        for times in self.overlap.values():
            start = prev = times[0]
            for t in times[1:]:
                if t - prev > 3 * SAMPLE_EVERY:
                    start = t
                prev = t
                best = max(best, prev - start + SAMPLE_EVERY)
            best = max(best, SAMPLE_EVERY)
        return best
