"""Reading a process's memory from /proc, for the benchmarks."""

from __future__ import annotations

from pathlib import Path


def status_mib(pid: int, field: str) -> float:
    """A /proc/<pid>/status memory field in MiB: "VmRSS" (now) or "VmHWM" (the peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far, in seconds (/proc/<pid>/stat)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
