"""One attempt's process: started in its own process group (so a kill reaches every child),
its output streamed out in chunks, stopped with SIGTERM then SIGKILL after a grace period."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Protocol

OutputSink = Callable[[str, bytes], Awaitable[None]]

_PR_SET_PDEATHSIG = 1


def _resolve_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


# Resolved once here, so the forked child only makes the call (no loading after fork).
_prctl = _resolve_prctl()


def _die_with_the_agent() -> None:
    """In the child, before exec: if the agent dies (even SIGKILL), the kernel kills the
    task's main process. Its own children are left to the next incarnation's orphan sweep."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"terminated by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"terminated by signal {-returncode}"
    return f"exited with code {returncode}" if returncode else ""


class Runnable(Protocol):
    """What the agent runs an attempt as: a real process, or a simulated one."""

    @property
    def pid(self) -> int | None: ...

    async def start(self) -> None: ...

    async def wait(self) -> int: ...

    async def stop(self, grace: float) -> None: ...


class AttemptProcess:
    def __init__(self, argv: list[str], env: dict[str, str], cwd: str, sink: OutputSink) -> None:
        self.argv = argv
        self.env = env
        self.cwd = cwd
        self.sink = sink
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def start(self) -> None:
        """Raises OSError (e.g. FileNotFoundError) when the command cannot be started."""
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            cwd=self.cwd,
            env=self.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_the_agent if _prctl is not None else None,
        )

    async def wait(self) -> int:
        assert self.proc is not None and self.proc.stdout and self.proc.stderr
        await asyncio.gather(
            self._pump("stdout", self.proc.stdout), self._pump("stderr", self.proc.stderr)
        )
        return await self.proc.wait()

    async def _pump(self, name: str, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            await self.sink(name, chunk)

    async def stop(self, grace: float) -> None:
        """SIGTERM to the process group, SIGKILL after `grace` seconds if still there."""
        if self.proc is None or self.proc.returncode is not None:
            return
        signal_group(self.proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(self.proc.wait()), timeout=grace)
        except TimeoutError:
            signal_group(self.proc.pid, signal.SIGKILL)


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
