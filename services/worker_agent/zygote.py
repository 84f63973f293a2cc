"""The agent's end of the supervisor zygote (supervise.py --zygote, whose docstring gives the
protocol): one pre-started supervisor that forks supervisors, so an attempt's start costs no
Python start. A forked supervisor whose attempt has ended waits for the next one (a *pooled*
supervisor, on a socket of its own), so most attempts cost no fork either. Whatever goes
wrong with the zygote or a pooled supervisor (it died, is paused, the request is too large)
makes `spawn` answer None, and the caller execs a supervisor instead."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from berth.services.worker_agent.pipe_reader import PipeReader
from berth.services.worker_agent.supervise import IDLE_REQUEST, MAX_REQUEST

# The per-task supervisor (its docstring says what it guarantees), run by path so that it
# needs nothing but the standard library.
SUPERVISOR = str(Path(__file__).with_name("supervise.py"))
# How long a forked supervisor may take to say its pid; a zygote slower than that (paused,
# or starved) is killed and started again, and this attempt's supervisor is exec'd.
START_TIMEOUT = 5.0
# Supervisors kept waiting for an attempt once theirs has ended; one more than that exits,
# and so does one left waiting for IDLE_FOR seconds (a burst's supervisors do not stay).
KEEP_IDLE = 32
IDLE_FOR = 300.0


class ZygoteRequest(msgspec.Struct):
    argv: list[str]
    env: dict[str, str]
    cwd: str
    fence_file: str
    deadline: float
    usage: bool  # measure what the tree used, and say it on the status pipe


class PipeWriter:
    """The agent's end of a forked supervisor's stdin (fence deadlines, a line each)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)

    def write(self, data: bytes) -> None:
        """Raises OSError once closed, or should the supervisor not read (a full pipe)."""
        if self.fd < 0:
            raise BrokenPipeError("closed")
        os.write(self.fd, data)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Forked:
    """A supervisor forked by the zygote, with the part of asyncio's Process that
    AttemptProcess uses. Not our child: its exit comes on its status pipe."""

    def __init__(self, pid: int, stdin: PipeWriter, stdout: PipeReader,
                 stderr: PipeReader, status: PipeReader,
                 ended: Callable[[bool], None] = lambda reported: None) -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self.usage = b""  # what the tree used (JSON), if the request asked for it
        # Called once the supervisor is done with this attempt: whether it reported the
        # exit (it lives on, and may take another), or not (it was SIGKILLed).
        self.ended = ended
        self._exit = asyncio.ensure_future(self._collect(status))

    async def _collect(self, status: PipeReader) -> int:
        last = b""
        while line := await status.readline():
            if line.startswith(b"{"):
                self.usage = line
            else:
                last = line
        try:
            # No status: the supervisor itself was SIGKILLed (the last resort of a stop).
            self.returncode = int(last) if last else -signal.SIGKILL
        except ValueError:
            self.returncode = -signal.SIGKILL
        # It stays (its pid, our process group id, not reused) until this closes. Only then
        # may it take another attempt: no signal of ours for this one can reach the next.
        self.stdin.close()
        self.ended(bool(last))
        return self.returncode

    async def wait(self) -> int:
        return await asyncio.shield(self._exit)


class Zygote:
    def __init__(self, keep_idle: int = KEEP_IDLE) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.keep_idle = keep_idle
        # Our ends of the pooled supervisors' sockets, with when each became idle
        # (time.monotonic), the one used last at the end.
        self.idle: list[tuple[socket.socket, float]] = []
        # How many idle supervisors are kept however long they wait (`warm`).
        self.floor = 0
        self.closed = False

    def warm(self, count: int) -> int:
        """Has the zygote fork supervisors into the pool ahead of any attempt, up to `count`
        (at most `keep_idle`) idle, kept while they wait: the first attempts after the agent
        starts, a burst of them on a new host, cost no fork either (as Ray starts a worker
        per CPU ahead of its tasks). Returns how many were asked for. One that cannot start
        costs nothing but a failed send: the attempt it was for forks another."""
        self.floor = min(count, self.keep_idle)
        asked = 0
        while len(self.idle) < self.floor:
            sent, own = self._send_new(IDLE_REQUEST, [])
            if not sent or own is None:
                break
            self.idle.append((own, time.monotonic()))
            asked += 1
        return asked

    def _socket(self) -> socket.socket | None:
        if self.sock is not None and self.proc is not None and self.proc.poll() is None:
            return self.sock
        self._end_zygote()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", SUPERVISOR, "--zygote"], stdin=theirs.fileno(),
                stdout=subprocess.DEVNULL, start_new_session=True)
        except OSError:
            ours.close()
            return None
        finally:
            theirs.close()
        ours.setblocking(False)  # a paused zygote must not stop the agent's loop
        self.sock = ours
        return ours

    def _send(self, request: bytes, fds: list[int]) -> bool:
        sock = self._socket()
        if sock is None:
            return False
        try:
            socket.send_fds(sock, [request], fds)
        except OSError:
            self._end_zygote()
            return False
        return True

    def _send_pooled(self, request: bytes, fds: list[int]) -> socket.socket | None:
        """Sends `request` to a pooled supervisor; the socket of the one that took it."""
        self._let_go_of_old()
        while self.idle:
            own, _ = self.idle.pop()
            try:
                socket.send_fds(own, [request], fds)
                return own
            except OSError:  # it has exited since (killed, or out of memory)
                own.close()
        return None

    def _send_new(self, request: bytes, fds: list[int]) -> tuple[bool, socket.socket | None]:
        """Asks the zygote to fork a supervisor for `request`: whether it was sent, and our
        end of the socket the supervisor takes later attempts on (none if none are kept)."""
        if not self.keep_idle:
            return self._send(request, fds), None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sent = self._send(request, [*fds, theirs.fileno()])
        finally:
            theirs.close()
        if not sent:
            ours.close()
            return False, None
        ours.setblocking(False)  # a paused supervisor must not stop the agent's loop
        return True, ours

    def _ended(self, own: socket.socket | None, reported: bool) -> None:
        """A supervisor is done with its attempt: kept for the next, or let go (closing our
        end of its socket ends it)."""
        if own is None:
            return
        if reported and not self.closed and len(self.idle) < self.keep_idle:
            self.idle.append((own, time.monotonic()))
        else:
            own.close()

    def _let_go_of_old(self) -> None:
        """Ends the supervisors idle for IDLE_FOR or longer (the longest idle come first),
        but for the warm pool's `floor`."""
        too_old = time.monotonic() - IDLE_FOR
        while len(self.idle) > self.floor and self.idle[0][1] <= too_old:
            self.idle.pop(0)[0].close()

    async def spawn(self, request: ZygoteRequest) -> Forked | None:
        """A supervisor for `request`, or None: exec one instead."""
        message = msgspec.json.encode(request)
        if len(message) > MAX_REQUEST:
            return None
        theirs: list[int] = []
        ours: list[int] = []
        for _ in range(4):
            r, w = os.pipe()
            ours.append(r)
            theirs.append(w)
        # stdin is the other way round: they read, we write.
        ours[0], theirs[0] = theirs[0], ours[0]
        self.closed = False
        try:
            own = self._send_pooled(message, theirs)
            forked = own is None
            sent = not forked
            if forked:
                sent, own = self._send_new(message, theirs)
        finally:
            for fd in theirs:
                os.close(fd)
        stdin = PipeWriter(ours[0])
        if not sent:
            stdin.close()
            for fd in ours[1:]:
                os.close(fd)
            return None
        readers = [PipeReader(fd) for fd in ours[1:]]
        status = readers[2]
        try:
            pid = int(await status.readline(START_TIMEOUT))
        except (TimeoutError, ValueError):
            pid = 0
        if not pid:
            # Closing stdin first: a supervisor that takes the request late sees the agent
            # gone, and does not start the task.
            stdin.close()
            if own is not None:
                own.close()
            if forked:  # the zygote did not answer: it is started again for the next
                self._end_zygote()
            for reader in readers:
                reader.close()
            return None
        return Forked(pid, stdin, readers[0], readers[1], status,
                      lambda reported: self._ended(own, reported))

    def _end_zygote(self) -> None:
        """Ends the zygote (SIGKILL: a paused one too). Its supervisors carry on."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        """Ends the zygote and the pooled supervisors waiting for an attempt; those running
        one carry on to its end."""
        self._end_zygote()
        for own, _ in self.idle:
            own.close()
        self.idle.clear()
        self.closed = True
