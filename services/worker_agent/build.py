"""The BUILDING phase's rules, apart from running anything (the agent runs each line under
the task supervisor, services/worker_agent/service.py): which setup lines run, and the
FAILED reason of a build that failed, with the tail of its output."""

from __future__ import annotations

import shutil
from pathlib import Path

# When a bundle has a uv.lock and the spec gives no `setup`, this runs if uv is installed.
UV_SETUP = "uv sync --frozen"
TAIL_BYTES = 2048
TAIL_LINES = 20


def setup_lines(setup: list[str], task_dir: Path, path: str | None) -> list[str]:
    """The spec's setup, else `uv sync --frozen` for a uv project where uv is on `path`."""
    if setup:
        return list(setup)
    if (task_dir / "uv.lock").is_file() and shutil.which("uv", path=path):
        return [UV_SETUP]
    return []


class OutputTail:
    """The last TAIL_BYTES of a build's output (stdout and stderr as they came)."""

    def __init__(self) -> None:
        self.data = b""

    def add(self, chunk: bytes) -> None:
        self.data = (self.data + chunk)[-TAIL_BYTES:]

    def text(self) -> str:
        lines = self.data.decode("utf-8", errors="replace").splitlines()
        return "\n".join(lines[-TAIL_LINES:])


def failure(line: str, how: str, tail: OutputTail) -> str:
    """`build failed: <command> exited N` (or timed out, or ...), then the output's tail."""
    shown = line if len(line) <= 200 else line[:197] + "..."
    text = tail.text()
    return f"build failed: {shown} {how}" + (f"\n{text}" if text else "")
