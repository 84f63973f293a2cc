"""The per-task supervisor: a tiny process between the worker agent and one task, so that a
task never outlives the right to run.

    python3 -I -S supervise.py FENCE_FILE DEADLINE [USAGE_FILE] -- ARGV...
    python3 -I -S supervise.py --zygote        (stdin: a Unix socket from the agent)

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

A task is not started at all when the deadline has passed or the agent is gone already.
It starts with every signal at its default disposition (SIGPIPE included, which Python
ignores) and /dev/null as its stdin.

It measures what the tree used, and before it exits writes it to USAGE_FILE as JSON
(`cpu_seconds`, `peak_rss_mb`, `samples`): the CPU time of every descendant (all of them are
reaped here, so the kernel's count for our children has them all) and the most resident
memory the tree held at once (its sum, sampled each LONGEST_WAIT from FIRST_SAMPLE on; no
lower than the kernel's peak of its largest process, so a task shorter than a sample is
measured too).

It exits as the task did (the same code, or the same signal). It ignores SIGTERM, SIGINT and
SIGHUP: those are for the task (the agent signals the whole group), and the supervisor stays
to collect the task's exit. Standard library only, started with -I -S, so nothing needs
installing.

Started by exec, a supervisor costs an attempt 45-65 ms of CPU (a Python start, and its
imports: ctypes and json alone are ~25 ms). So the agent keeps one **zygote** (`--zygote`):
a supervisor with everything imported that forks supervisors. The agent sends it a
datagram per supervisor wanted, a JSON request (ZygoteRequest's fields) with four file
descriptors: the read end of the supervisor's stdin (the agent keeps the only write end, so
its death is still seen), the write ends of its stdout and stderr, and a *status* pipe, on
which the supervisor writes its pid as it starts and, once the tree is gone, what the tree
used (a JSON line, when the request asks for it) and its exit as a return code (`-N`:
signal N). It then stays, leading the group so that its pid is not reused, until the agent
closes its stdin.

A fifth descriptor, if sent, is a socket of the supervisor's own: once the agent has closed
its stdin, it waits there for the agent's next request (the same datagram, four pipes) and
runs that attempt, one at a time, until the agent closes the socket. A fork, and the pages
a new process copies as it first runs its Python, cost ~2.5 ms of CPU per attempt; a
supervisor that takes attempt after attempt costs ~0.1 ms beyond its task's own start
(bench/supervisor.py, docs/performance.md). What makes one attempt's supervision
independent of the last: every descendant of an attempt is gone before its exit is reported
(as a subreaper, its orphans are ours), what the tree used is counted from the children
reaped during the attempt, a SIGUSR1 received before the next pid line is dropped, and the
task gets only its three pipes. The forked supervisors do not depend on the zygote: its
death (or pause) stops new forks only. A request of IDLE_REQUEST with that socket alone
forks a supervisor that starts out waiting there: the agent's warm pool, so that the first
attempts after it starts cost no fork either.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import select
import signal
import socket
import sys
import time

# Not imported for real: a supervisor starts with the standard library's bare minimum.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn

PR_SET_CHILD_SUBREAPER = 36
# The longest sleep between looks at the deadline (a wait ends sooner on a child's exit, a
# signal, or a line from the agent).
LONGEST_WAIT = 1.0
# The first sample of the tree's memory: a task that ends sooner (most `true`s) is measured
# by the kernel's peak alone, and costs no look at /proc.
FIRST_SAMPLE = 0.1
# The largest request a zygote takes (argv and environment); the agent execs a supervisor
# for a larger one.
MAX_REQUEST = 1 << 17
ZYGOTE_FDS = 4  # stdin, stdout, stderr, status
# A request for a supervisor with no attempt yet, for the agent's warm pool: this message,
# with the supervisor's own socket as its only descriptor.
IDLE_REQUEST = b"idle"


def children_of(pid: int) -> list[int] | None:
    """`pid`'s children, from each of its threads' /proc children file; None without those
    files (a kernel without CONFIG_PROC_CHILDREN)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out  # it has gone (its children, if any, are re-parented to us)
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(c) for c in f.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread has ended
            return None
        except OSError:
            continue
    return out


def walk_proc(root: int) -> list[int]:
    """Every process below `root`, from a scan of all of /proc (the slow way)."""
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
    out: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def descendants(root: int) -> list[int]:
    """Every process below `root` (a subreaper's orphans included). Reads only the tree's
    own /proc children files: an exited child's orphans are re-parented to us before it
    becomes a zombie, so a tree whose root has no child (once reaped) is surely empty."""
    out: list[int] = []
    todo = [root]
    while todo:
        found = children_of(todo.pop())
        if found is None:
            return walk_proc(root)
        out.extend(found)
        todo.extend(found)
    return out


def resident_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total * os.sysconf("SC_PAGE_SIZE")


# Exit statuses of the children reaped during this attempt, by pid, and what they used: the
# CPU seconds, and the largest peak resident KiB of one of them (its own reaped children's
# included). A supervisor may run attempts one after another, so not the kernel's count of
# all our children's use, which only grows.
reaped: dict[int, int] = {}
used = [0.0, 0]
# SIGUSR1s received (the agent asking for the tree's end) not yet acted on.
asked: list[bool] = []


class Usage:
    """What the task's tree used: its peak resident memory, sampled. Measured when wanted:
    written to `path` (an exec'd supervisor), or else handed to `report` (a forked one)."""

    def __init__(self, path: str, wanted: bool = False) -> None:
        self.path = path
        self.wanted = wanted or bool(path)
        self.peak_bytes = 0
        self.samples = 0
        self.last = time.monotonic() - LONGEST_WAIT + FIRST_SAMPLE

    def due_in(self) -> float:
        """Seconds until the next sample is due (the wait below ends by then)."""
        if not self.wanted:
            return LONGEST_WAIT
        return max(0.0, self.last + LONGEST_WAIT - time.monotonic())

    def sample(self, me: int) -> None:
        if not self.wanted or self.due_in() > 0:
            return
        self.last = time.monotonic()
        self.peak_bytes = max(self.peak_bytes, resident_bytes(descendants(me)))
        self.samples += 1

    def write(self) -> str:
        """Once the tree is reaped (its CPU time is all in our children's count): the
        measure as a JSON line, also written to `path` if there is one; "" if unwanted."""
        if not self.wanted:
            return ""
        cpu, peak_kib = used
        peak = max(self.peak_bytes, peak_kib * 1024)
        # One write of C-encoded JSON: json.dump encodes in Python, a write per token.
        # To the microsecond, as rusage has it: a `true` uses under a millisecond, and
        # a sum over many short tasks is only right with their own figures.
        text = json.dumps({"cpu_seconds": round(cpu, 6),
                           "peak_rss_mb": round(peak / 2**20, 1), "samples": self.samples})
        if self.path:
            with contextlib.suppress(OSError):
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
                try:
                    os.write(fd, text.encode())
                finally:
                    os.close(fd)
        return text


def kill_tree(me: int) -> None:
    """SIGKILL to every descendant until none is left (a dying tree may still fork)."""
    for _ in range(100):
        if not reap():
            # No child at all, so no descendant: every process of the tree has a parent
            # below us, and one whose parent has died is re-parented to us (a subreaper)
            # before that parent can be reaped. Most attempts end here, with no look at
            # /proc.
            return
        found = descendants(me)
        if not found:
            return
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        reap()
        time.sleep(0.01)


def reap() -> bool:
    """Collects exited children (orphans re-parented to us included) so none is a zombie;
    returns whether any child is left."""
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        reaped[pid] = status
        used[0] += usage.ru_utime + usage.ru_stime
        used[1] = max(used[1], usage.ru_maxrss)


def returncode(status: int) -> int:
    """A wait status as asyncio and subprocess report it (-N: killed by signal N)."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1


def forget_children() -> None:
    """Reaps exited children without keeping their statuses (the zygote's)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def exit_like(status: int) -> None:
    """Ends this process the way the task ended: its exit code, or its signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    os._exit(returncode(status))


class Agent:
    """Our stdin: the agent's renewals of the fence deadline, and its end closing."""

    def __init__(self, fd: int, deadline: float) -> None:
        self.fd = fd
        self.deadline = deadline
        self.gone = False
        self.pending = b""

    def read(self) -> None:
        data = os.read(self.fd, 4096)
        if not data:
            self.gone = True
            return
        self.pending += data
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            with contextlib.suppress(ValueError):
                self.deadline = max(self.deadline, float(line))

    def poll(self) -> None:
        """Reads what is there without waiting."""
        while not self.gone and select.select([self.fd], [], [], 0)[0]:
            self.read()


def libc_prctl() -> object:
    # Not on Linux: the process group is all there is.
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None, use_errno=True).prctl
    return None


def become_subreaper(prctl: object = None) -> None:
    prctl = prctl or libc_prctl()
    if callable(prctl):
        prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def fence(fence_file: str, agent: Agent) -> None:
    with contextlib.suppress(OSError), open(fence_file, "w") as f:
        f.write("the agent is gone\n" if agent.gone else
                "no heartbeat acknowledged before the fence deadline\n")


def report(status_fd: int, code: int, usage: str = "") -> None:
    """Tells the agent the attempt's exit (a forked supervisor), after what the tree used if
    that was measured (a JSON line), and returns once the agent has closed our stdin: until
    then we lead the attempt's process group, so that its id is not reused."""
    with contextlib.suppress(OSError):
        os.write(status_fd, (f"{usage}\n{code}\n" if usage else f"{code}\n").encode())
    # The agent reads its pipes to their ends: ours close now, not when we exit.
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(status_fd)
    with contextlib.suppress(OSError):
        while os.read(0, 4096):
            pass
    os.dup2(devnull, 0)
    os.close(devnull)


def prepare(prctl: object = None) -> int:
    """What a supervisor process sets up once, for every attempt it runs: it becomes a
    subreaper, leaves the group's signals to the task, and hears SIGUSR1 and its children's
    exits. Returns the read end of the pipe those signals wake the wait below through, so
    that an attempt's exit is reported without a polling delay."""
    become_subreaper(prctl)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, lambda *_: asked.append(True))
    wake, woken = os.pipe()
    os.set_blocking(wake, False)
    os.set_blocking(woken, False)
    signal.set_wakeup_fd(woken)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    return wake


def run_attempt(fence_file: str, deadline: float, usage: Usage, command: list[str],
                env: dict[str, str] | None, wake: int) -> tuple[int, int | None, str]:
    """Runs `command` under this process's supervision until its whole tree is gone (our
    stdin: the agent's). Returns the code to report, the task's wait status (None if it
    was not started, or was fenced off) and what the tree used (usage.write)."""
    me = os.getpid()
    reaped.clear()
    used[:] = [0.0, 0]
    agent = Agent(0, deadline)
    agent.poll()
    if agent.gone or time.monotonic() > agent.deadline:
        # Never started: e.g. a request the agent gave up on, forked late (which has no
        # fence file to write: the same name may be an exec'd supervisor's by now).
        if not agent.gone:
            fence(fence_file, agent)
        return 137, None, ""

    # posix_spawn (a vfork underneath): no copy of this process's memory map to make.
    # Signals this process ignores or handles, and the ones Python ignores (SIGPIPE,
    # SIGXFSZ), are the task's defaults again.
    try:
        child = os.posix_spawnp(
            command[0], command, os.environ if env is None else env,
            file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)],
            setsigdef=(signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                       signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ),
            setsigmask=())
    except OSError as exc:
        os.write(2, f"cannot start {command[0]!r}: {exc.strerror}\n".encode())
        return 127, None, usage.write()

    while True:
        reap()
        if child in reaped:
            kill_tree(me)
            return returncode(reaped[child]), reaped[child], usage.write()
        if asked:
            kill_tree(me)
            asked.clear()
            continue
        if agent.gone or time.monotonic() > agent.deadline:
            fence(fence_file, agent)
            kill_tree(me)
            return 137, None, usage.write()
        usage.sample(me)
        wait = min(LONGEST_WAIT, max(0.0, agent.deadline - time.monotonic()), usage.due_in())
        try:
            ready, _, _ = select.select([0, wake], [], [], wait)
        except InterruptedError:
            continue
        if wake in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake, 4096)
        if 0 in ready:
            agent.read()


def supervise(fence_file: str, deadline: float, usage_path: str, command: list[str]) -> None:
    """An exec'd supervisor: runs `command` to its end and exits as it did (never returns)."""
    code, status, _ = run_attempt(fence_file, deadline, Usage(usage_path), command, None,
                                  prepare())
    if status is None:
        os._exit(code)
    exit_like(status)


def serve(sock: socket.socket) -> None:
    """The zygote: forks a supervisor for each request until the agent's end closes."""
    # Our children (the supervisors) are reaped here, though their exits go to the agent
    # through their status pipes: so what they used counts in ours. A supervisor sets its
    # own SIGCHLD handler.
    signal.signal(signal.SIGCHLD, lambda *_: forget_children())
    # SIGUSR1 too: a forked supervisor may be asked before it has set its handler.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    prctl = libc_prctl()
    # What is here now stays as it is: no collection in a forked child walks (and so
    # copies) the pages it shares with us.
    gc.freeze()
    while True:
        message, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, ZYGOTE_FDS + 1)
        if not message and not fds:
            return  # the agent is gone
        if message == IDLE_REQUEST and len(fds) == 1:
            # A failed fork closes the socket below: the agent's first request on it fails,
            # and it forks or execs a supervisor then.
            with contextlib.suppress(OSError):
                if os.fork() == 0:
                    start_idle(sock, fds[0], prctl)
        elif len(fds) in (ZYGOTE_FDS, ZYGOTE_FDS + 1):
            # A failed fork closes the fds below: the agent sees no pid and execs instead.
            with contextlib.suppress(OSError):
                if os.fork() == 0:
                    start_forked(sock, message, fds, prctl)
        for fd in fds:
            os.close(fd)


def start_forked(sock: socket.socket, message: bytes, fds: list[int], prctl: object
                 ) -> NoReturn:
    """In the zygote's child: becomes a supervisor and runs the request's attempt; then, if
    the request came with a socket of its own (a fifth fd), each attempt the agent sends on
    it, one at a time, until the agent closes it (never returns)."""
    own = None
    try:
        if len(fds) > ZYGOTE_FDS:
            own = socket.socket(fileno=fds.pop())
        wake = become_supervisor(sock, own, prctl)
    except BaseException as exc:
        failed(fds[3], exc, own)
    serve_attempts(message, fds, wake, own)


def start_idle(sock: socket.socket, own_fd: int, prctl: object) -> NoReturn:
    """In the zygote's child: becomes a supervisor as start_forked does, for the agent's
    warm pool, and waits on its own socket for its first attempt (never returns)."""
    try:
        own = socket.socket(fileno=own_fd)
        wake = become_supervisor(sock, own, prctl)
        message, fds = next_request(own)
    except BaseException:
        os._exit(1)  # the agent's request on our socket fails: it starts the attempt anew
    if not fds:
        os._exit(0)  # the agent closed it before any attempt
    serve_attempts(message, fds, wake, own)


def become_supervisor(sock: socket.socket, own: socket.socket | None, prctl: object) -> int:
    """What a forked supervisor sets up once, in its own session; returns prepare()'s."""
    sock.close()  # fd 0: it stays taken (each attempt's stdin goes there), not the
    null = os.open(os.devnull, os.O_RDONLY)  # pipe prepare() makes
    if null != 0:
        os.dup2(null, 0)
        os.close(null)
    os.setsid()
    wake = prepare(prctl)
    if own is not None:
        own.set_inheritable(False)  # not the task's: only the agent sends on it
    return wake


def serve_attempts(message: bytes, fds: list[int], wake: int, own: socket.socket | None
                   ) -> NoReturn:
    """Runs the attempt, then each the agent sends on `own`, one at a time, until the agent
    closes it (never returns)."""
    try:
        while True:
            run_forked(message, fds, wake, own)
            if own is None:
                break
            message, fds = next_request(own)
            if not fds:
                break  # the agent closed it (it is gone, or keeps fewer of us)
    finally:
        os._exit(0)  # whatever happened, never back into the zygote's loop


def run_forked(message: bytes, fds: list[int], wake: int, own: socket.socket | None) -> None:
    """One attempt of a forked supervisor: `message` (a ZygoteRequest's JSON) with its
    stdin, stdout, stderr and status pipes. Returns once it is reported and the agent has
    closed its stdin."""
    stdin, stdout, stderr, status = fds
    # The agent signals this attempt only once it has our pid from the line below: a
    # SIGUSR1 that came before it was for an attempt of ours that has ended.
    asked.clear()
    try:
        os.write(status, f"{os.getpid()}\n".encode())
        os.set_inheritable(status, False)
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
        for fd in (stdin, stdout, stderr):
            if fd > 2:
                os.close(fd)
        request = json.loads(message)
        os.chdir(request["cwd"])
        # posix_spawnp looks for the program on our own PATH: the task's becomes ours. The
        # rest of its environment goes to the task alone (rewriting all of ours cost a
        # forked supervisor a fifth of its CPU).
        env: dict[str, str] = request["env"]
        if "PATH" in env:
            os.environ["PATH"] = env["PATH"]
        else:
            os.environ.pop("PATH", None)
        # What the tree used comes back on the status pipe: no file to create, read and
        # remove per attempt (a file's creation alone was a fifth of a forked supervisor).
        code, _, usage = run_attempt(request["fence_file"], float(request["deadline"]),
                                     Usage("", bool(request["usage"])),
                                     list(request["argv"]), env, wake)
    except BaseException as exc:
        failed(status, exc, own)
    report(status, code, usage)
    with contextlib.suppress(OSError):
        os.chdir("/")  # not the attempt's directory, which may be removed


def failed(status: int, exc: BaseException, own: socket.socket | None = None) -> NoReturn:
    """Whatever went wrong, the agent must hear of it, and nothing of the attempt stays.
    Our socket closes first: by the time the agent reads the exit, a request sent to us
    fails at once instead of waiting for a pid that never comes."""
    with contextlib.suppress(BaseException):
        if own is not None:
            own.close()
        kill_tree(os.getpid())
    with contextlib.suppress(OSError):
        os.write(2, f"berth supervisor: cannot start the attempt: {exc!r}\n".encode())
        os.write(status, b"127\n")
    os._exit(127)


def next_request(own: socket.socket) -> tuple[bytes, list[int]]:
    """The next attempt the agent sends a pooled supervisor, with its four pipes; no fds
    once the agent has closed the socket (or sent something else: we end)."""
    try:
        message, fds, _, _ = socket.recv_fds(own, MAX_REQUEST, ZYGOTE_FDS)
    except OSError:
        return b"", []
    if len(fds) != ZYGOTE_FDS:
        for fd in fds:
            os.close(fd)
        return b"", []
    return message, fds


def main(argv: list[str]) -> None:
    if argv == ["--zygote"]:
        serve(socket.socket(fileno=0))
        return
    fence_file, deadline_text, *rest = argv
    usage = rest.pop(0) if rest and rest[0] != "--" else ""
    separator, *command = rest or [""]
    if separator != "--" or not command:
        sys.exit("usage: supervise.py FENCE_FILE DEADLINE [USAGE_FILE] -- ARGV...")
    supervise(fence_file, float(deadline_text), usage, command)


if __name__ == "__main__":
    main(sys.argv[1:])
