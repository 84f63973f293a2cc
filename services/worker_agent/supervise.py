"""The per-task supervisor: a tiny process between the worker agent and one task, so that a
task never outlives the right to run.

    python3 -I -S supervise.py FENCE_FILE DEADLINE [USAGE_FILE] -- ARGV...

It starts ARGV as its child (in its own process group, which the supervisor leads) and
becomes a child subreaper, so every descendant the task leaves behind, even one that
escaped into a session of its own, is re-parented to it. It kills the whole tree, with
SIGKILL, when:

- the agent is gone (its end of our stdin closes: SIGKILL of the agent included);
- the fence deadline passes: the agent renews it, a `CLOCK_MONOTONIC` time, by writing a
  line to our stdin each time the scheduler acknowledges one of its heartbeats. An agent
  that is paused, or cut off from the scheduler, stops renewing, and its tasks die before
  the scheduler may declare it dead and run them elsewhere (docs/reliability.md). Then it
  writes FENCE_FILE, so the agent knows why;
- the agent asks for it (SIGUSR1: the end of a kill's grace period);
- the task's main process has exited (nothing of an attempt outlives it).

It measures what the tree used, and before it exits writes it to USAGE_FILE as JSON
(`cpu_seconds`, `peak_rss_mb`, `samples`): the CPU time of every descendant (all of them are
reaped here, so the kernel's count for our children has them all) and the most resident
memory the tree held at once (its sum, sampled each LONGEST_WAIT; no lower than the
kernel's peak of its largest process, so a task shorter than a sample is measured too).

It exits as the task did (the same code, or the same signal). It ignores SIGTERM, SIGINT and
SIGHUP: those are for the task (the agent signals the whole group), and the supervisor stays
to collect the task's exit. Standard library only, started with -I -S, so nothing needs
installing; its start costs an attempt about 35 ms (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
# The longest sleep between looks at the deadline (a wait ends sooner on a child's exit, a
# signal, or a line from the agent).
LONGEST_WAIT = 1.0


def descendants(root: int, rss: dict[int, int] | None = None) -> list[int]:
    """Every process below `root`, from /proc (a subreaper's orphans included). `rss`, if
    given, is filled with each process's resident pages (read in the same pass)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: fields start after the last ')'.
        fields = stat[stat.rindex(b")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
        if rss is not None:
            rss[int(entry)] = int(fields[21])  # proc(5)'s field 24, rss
    out: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


# Exit statuses of the children reaped so far, by pid.
reaped: dict[int, int] = {}


class Usage:
    """What the task's tree used: its peak resident memory, sampled."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.peak_bytes = 0
        self.samples = 0
        self.last = 0.0

    def due_in(self) -> float:
        """Seconds until the next sample is due (the wait below ends by then)."""
        if not self.path:
            return LONGEST_WAIT
        return max(0.0, self.last + LONGEST_WAIT - time.monotonic())

    def sample(self, me: int) -> None:
        if not self.path or self.due_in() > 0:
            return
        self.last = time.monotonic()
        rss: dict[int, int] = {}
        tree = descendants(me, rss)
        self.peak_bytes = max(self.peak_bytes,
                              sum(rss.get(p, 0) for p in tree) * os.sysconf("SC_PAGE_SIZE"))
        self.samples += 1

    def write(self) -> None:
        """Once the tree is reaped: its CPU time is all in our children's count."""
        if not self.path:
            return
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        peak = max(self.peak_bytes, children.ru_maxrss * 1024)  # ru_maxrss is in KiB
        with contextlib.suppress(OSError), open(self.path, "w") as f:
            json.dump({"cpu_seconds": round(children.ru_utime + children.ru_stime, 3),
                       "peak_rss_mb": round(peak / 2**20, 1),
                       "samples": self.samples}, f)


def kill_tree(me: int) -> None:
    """SIGKILL to every descendant until none is left (a dying tree may still fork)."""
    for _ in range(100):
        found = descendants(me)
        if not found:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        reap()
        time.sleep(0.01)


def reap() -> None:
    """Collects exited children (orphans re-parented to us included) so none is a zombie."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        reaped[pid] = status


def exit_like(status: int) -> None:
    """Ends this process the way the task ended: its exit code, or its signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def main(argv: list[str]) -> None:
    fence_file, deadline_text, *rest = argv
    usage = Usage(rest.pop(0) if rest and rest[0] != "--" else "")
    separator, *command = rest or [""]
    if separator != "--" or not command:
        sys.exit("usage: supervise.py FENCE_FILE DEADLINE [USAGE_FILE] -- ARGV...")
    deadline = float(deadline_text)
    me = os.getpid()
    # Not on Linux: the process group is all there is.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    asked = []
    signal.signal(signal.SIGUSR1, lambda *_: asked.append(True))
    # A child's exit (SIGCHLD) and SIGUSR1 wake the wait below at once, through this pipe:
    # the attempt's exit is reported without a polling delay.
    wake, woken = os.pipe()
    os.set_blocking(wake, False)
    os.set_blocking(woken, False)
    signal.set_wakeup_fd(woken)
    signal.signal(signal.SIGCHLD, lambda *_: None)

    stdin = sys.stdin.fileno()
    child = os.fork()
    if child == 0:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                    signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        try:
            os.execvp(command[0], command)
        except OSError as exc:
            os.write(2, f"cannot start {command[0]!r}: {exc.strerror}\n".encode())
            os._exit(127)

    pending = b""
    agent_gone = False
    while True:
        reap()
        if child in reaped:
            kill_tree(me)
            usage.write()
            exit_like(reaped[child])
        if asked:
            kill_tree(me)
            asked.clear()
            continue
        if agent_gone or time.monotonic() > deadline:
            with open(fence_file, "w") as f:
                f.write("the agent is gone\n" if agent_gone else
                        "no heartbeat acknowledged before the fence deadline\n")
            kill_tree(me)
            usage.write()
            os._exit(137)
        usage.sample(me)
        wait = min(LONGEST_WAIT, max(0.0, deadline - time.monotonic()), usage.due_in())
        try:
            ready, _, _ = select.select([stdin, wake], [], [], wait)
        except InterruptedError:
            continue
        if wake in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake, 4096)
        if stdin in ready:
            data = os.read(stdin, 4096)
            if not data:
                agent_gone = True
                continue
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                with contextlib.suppress(ValueError):
                    deadline = max(deadline, float(line))


if __name__ == "__main__":
    main(sys.argv[1:])
