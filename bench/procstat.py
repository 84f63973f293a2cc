"""Reading a process's memory from /proc, for the benchmarks."""

from __future__ import annotations

from pathlib import Path


def status_mib(pid: int, field: str) -> float:
    """A /proc/<pid>/status memory field in MiB: "VmRSS" (now) or "VmHWM" (the peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int, reaped: bool = False) -> float:
    """User plus system CPU time a process has used so far, in seconds (/proc/<pid>/stat);
    with `reaped`, also that of its children it has waited for (a worker's tasks). 0 for
    a process that is gone."""
    import os

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        # Gone before the open, or between the open and the read (ESRCH): a zygote's
        # attempt that exits while its tree is walked.
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if reaped:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


def live_children(pid: int) -> list[int]:
    """`pid`'s children now (from each of its threads' /proc children file)."""
    out: list[int] = []
    try:
        for tid in Path(f"/proc/{pid}/task").iterdir():
            try:
                out.extend(int(c) for c in (tid / "children").read_text().split())
            except OSError:
                continue
    except OSError:
        pass
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process, its reaped children, and its live descendants with theirs
    (a worker's supervisor zygote, and the attempts it has forked, are not reaped yet)."""
    todo, total = [pid], 0.0
    while todo:
        p = todo.pop()
        total += cpu_seconds(p, reaped=True)
        todo.extend(live_children(p))
    return total


def cpu_by_process(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each labelled process, its descendants (live or reaped)
    included."""
    return {label: tree_cpu_seconds(pid) for label, pid in pids.items()}


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each process spent between two `cpu_by_process` readings."""
    return {label: round(after[label] - before.get(label, 0.0), 2) for label in after}


def machine_busy_seconds() -> float:
    """CPU seconds every core of this machine has spent busy so far (/proc/stat: user,
    nice, system, irq and softirq; not idle, I/O wait or time stolen by a hypervisor).
    A process's own figures (`cpu_seconds`) are whole clock ticks, each rounded down: a
    supervisor that runs a few `true`s reads 0, so a workload of many short processes
    reads far less there than it used (P1: about half). This one misses nothing."""
    import os

    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """This process's CPU seconds so far (its rusage: exact, not in clock ticks)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

