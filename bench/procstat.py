"""Reading a process's memory from /proc, for the benchmarks."""

from __future__ import annotations

from pathlib import Path


def status_mib(pid: int, field: str) -> float:
    """A /proc/<pid>/status memory field in MiB: "VmRSS" (now) or "VmHWM" (the peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0
