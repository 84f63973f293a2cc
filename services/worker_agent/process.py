"""One attempt's process: started under its own supervisor (services/worker_agent/supervise.py),
which leads the attempt's process group, owns every descendant and kills them all when the
agent dies or stops renewing the fence deadline; output streamed out in chunks; stopped with
SIGTERM to the group, then SIGKILL of the whole tree after a grace period."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import msgspec

from berth.services.worker_agent.pipe_reader import PipeReader
from berth.services.worker_agent.zygote import SUPERVISOR, Forked, Zygote, ZygoteRequest
from berth.shared.messages import ResourceUse

OutputSink = Callable[[str, bytes], Awaitable[None]]



def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"terminated by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"terminated by signal {-returncode}"
    return f"exited with code {returncode}" if returncode else ""


# Programs found on a PATH before, kept for the next attempt with the same command: a PATH
# search is a look in each directory, ~40 µs per attempt (the whole of it: one access call).
_found: dict[tuple[str, str], str] = {}
MAX_FOUND = 256


def find_program(program: str, path: str) -> str | None:
    """shutil.which's answer, remembered while that file stays executable. Only a check, for
    a clear error before anything starts: the supervisor's exec searches the PATH itself, so
    a program put earlier on the PATH since is still the one that runs."""
    key = (program, path)
    found = _found.get(key)
    if found is not None and os.access(found, os.X_OK):
        return found
    found = shutil.which(program, path=path)
    if found is None:
        _found.pop(key, None)
        return None
    if len(_found) >= MAX_FOUND:
        _found.clear()
    _found[key] = found
    return found


class Runnable(Protocol):
    """What the agent runs an attempt as: a real process, or a simulated one."""

    @property
    def pid(self) -> int | None: ...

    async def start(self) -> None: ...

    async def wait(self) -> int: ...

    async def stop(self, grace: float) -> None: ...

    def renew(self, deadline: float) -> None: ...

    @property
    def fenced(self) -> str: ...

    @property
    def usage(self) -> ResourceUse | None: ...


class AttemptProcess:
    def __init__(self, argv: list[str], env: dict[str, str], cwd: str, sink: OutputSink,
                 deadline: float, fence_file: Path | None = None,
                 usage_file: Path | None = None, zygote: Zygote | None = None) -> None:
        self.argv = argv
        self.env = env
        self.cwd = cwd
        self.sink = sink
        self.deadline = deadline
        # Written by the supervisor when it fenced the attempt off, saying why.
        self.fence_file = fence_file or Path(cwd) / ".berth-fenced"
        # Written by the supervisor as it exits: what the process tree used.
        self.usage_file = usage_file
        # Forks the supervisor (None, or a zygote that cannot: it is exec'd).
        self.zygote = zygote
        self.proc: asyncio.subprocess.Process | Forked | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def start(self) -> None:
        """Raises OSError (e.g. FileNotFoundError) when the command cannot be started."""
        program = self.argv[0]
        if "/" in program:
            found: str | None = str(Path(self.cwd, program))
            if not os.access(str(found), os.X_OK):
                found = None
        else:
            found = find_program(program, self.env.get("PATH", os.defpath))
        if found is None:
            raise FileNotFoundError(2, "No such file or directory", program)
        self.fence_file.unlink(missing_ok=True)
        if self.zygote is not None:
            self.proc = await self.zygote.spawn(ZygoteRequest(
                argv=self.argv, env=self.env, cwd=self.cwd, fence_file=str(self.fence_file),
                deadline=self.deadline, usage=self.usage_file is not None))
            if self.proc is not None:
                return
        usage = []
        if self.usage_file is not None:
            self.usage_file.unlink(missing_ok=True)
            usage = [str(self.usage_file)]
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", SUPERVISOR, str(self.fence_file), repr(self.deadline),
            *usage, "--", *self.argv,
            cwd=self.cwd,
            env=self.env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )

    def renew(self, deadline: float) -> None:
        """Moves the fence deadline (a CLOCK_MONOTONIC time) later."""
        if deadline <= self.deadline or self.proc is None or self.proc.stdin is None:
            return
        self.deadline = deadline
        with contextlib.suppress(OSError, RuntimeError):  # it has just exited
            self.proc.stdin.write(f"{deadline!r}\n".encode())

    @property
    def fenced(self) -> str:
        """Why the supervisor fenced this attempt off, or "" if it did not."""
        try:
            return self.fence_file.read_text().strip()
        except OSError:
            return ""

    @property
    def usage(self) -> ResourceUse | None:
        """What the process tree used, once it has exited (None: not measured)."""
        if self.usage_file is None:
            return None
        try:
            if isinstance(self.proc, Forked):  # a forked supervisor says it on its status pipe
                return msgspec.json.decode(self.proc.usage, type=ResourceUse) if (
                    self.proc.usage) else None
            return msgspec.json.decode(self.usage_file.read_bytes(), type=ResourceUse)
        except (OSError, msgspec.DecodeError):
            return None

    async def wait(self) -> int:
        assert self.proc is not None and self.proc.stdout and self.proc.stderr
        # A short task has ended by now, often with nothing written: a stream already
        # drained needs no pump, and a lone one no task of its own.
        pumps = [self._pump(name, stream) for name, stream in
                 (("stdout", self.proc.stdout), ("stderr", self.proc.stderr))
                 if not (isinstance(stream, PipeReader) and stream.drained)]
        if len(pumps) == 2:
            await asyncio.gather(*pumps)
        elif pumps:
            await pumps[0]
        return await self.proc.wait()

    async def _pump(self, name: str, stream: asyncio.StreamReader | PipeReader) -> None:
        while chunk := await stream.read(65536):
            await self.sink(name, chunk)

    async def stop(self, grace: float) -> None:
        """SIGTERM to the process group; after `grace` seconds, the supervisor kills the
        whole tree (SIGUSR1), and should it not answer, the group gets SIGKILL."""
        if self.proc is None or self.proc.returncode is not None:
            return
        signal_group(self.proc.pid, signal.SIGTERM)
        for last_resort in (False, True):
            try:
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), timeout=grace)
                return
            except TimeoutError:
                if self._exited():
                    # It ended as the wait timed out: its supervisor may be running
                    # another attempt by now (zygote.py), which no signal of ours is for.
                    return
                if last_resort:
                    signal_group(self.proc.pid, signal.SIGKILL)
                else:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.proc.pid, signal.SIGUSR1)
                    grace = 1.0

    def _exited(self) -> bool:
        return self.proc is not None and self.proc.returncode is not None


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
