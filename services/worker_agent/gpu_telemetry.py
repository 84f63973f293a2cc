"""What the worker's GPUs are doing: per attempt (memory peak, SM utilisation of the
processes below its supervisor, sent with its exit report) and per device (utilisation,
memory in use, temperature, sent with each heartbeat). Read through NVML."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from berth.services.worker_agent.gpus import Nvml
from berth.shared.messages import DeviceInfo, DeviceStats, GpuTelemetry


def parent_of(pid: int) -> int | None:
    """The parent of a process (Linux /proc), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    fields = stat[stat.rfind(b")") + 2:].split()
    return int(fields[1]) if len(fields) > 1 else None


def owner(pid: int, roots: dict[int, str], parent: Callable[[int], int | None] = parent_of
          ) -> str | None:
    """The attempt whose supervisor (`roots`: pid -> attempt key) `pid` descends from: the
    supervisor reaps every descendant, so even a daemonised one stays below it."""
    for _ in range(64):
        if pid in roots:
            return roots[pid]
        up = parent(pid)
        if up is None or up <= 1:
            return None
        pid = up
    return None


@dataclass
class Usage:
    """One attempt's GPU figures so far."""

    peak_memory_mb: int = 0
    utilization: list[int] = field(default_factory=list)

    def telemetry(self) -> GpuTelemetry:
        util = self.utilization
        return GpuTelemetry(
            peak_memory_mb=self.peak_memory_mb,
            mean_utilization=round(sum(util) / len(util), 1) if util else None,
            peak_utilization=max(util) if util else None, samples=len(util))


class Sampler:
    """Samples, through NVML, what each running attempt's processes use of the worker's
    GPUs: memory (summed over its processes and devices at each sample; the peak kept) and
    SM utilisation (per sample, the busiest of its processes). NVML must be initialised."""

    def __init__(self, nvml: Nvml, devices: Sequence[DeviceInfo],
                 parent: Callable[[int], int | None] = parent_of) -> None:
        self.nvml = nvml
        self.devices = [d for d in devices if d.uuid]
        self.parent = parent
        self.usage: dict[str, Usage] = {}
        self.since: dict[str, int] = {}  # per device: the newest utilisation sample seen

    def sample(self, roots: dict[int, str]) -> None:
        """One round over every device; `roots`: supervisor pid -> attempt key of the
        attempts running now."""
        memory: dict[str, int] = {}
        busiest: dict[str, int] = {}
        for d in self.devices:
            try:
                handle = self.nvml.nvmlDeviceGetHandleByUUID(d.uuid)
                procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except self.nvml.NVMLError:
                continue  # the health watch reports a device NVML cannot reach
            for p in procs:
                key = owner(p.pid, roots, self.parent)
                if key is not None and p.usedGpuMemory is not None:
                    memory[key] = memory.get(key, 0) + int(p.usedGpuMemory) // (1024 * 1024)
            try:
                samples = self.nvml.nvmlDeviceGetProcessUtilization(
                    handle, self.since.get(d.uuid, 0))
            except self.nvml.NVMLError:
                continue  # no sample since the last (NotFound), or not supported
            for s in samples:
                self.since[d.uuid] = max(self.since.get(d.uuid, 0), int(s.timeStamp))
                key = owner(s.pid, roots, self.parent)
                if key is not None:
                    busiest[key] = max(busiest.get(key, 0), int(s.smUtil))
        for key in roots.values():
            usage = self.usage.setdefault(key, Usage())
            usage.peak_memory_mb = max(usage.peak_memory_mb, memory.get(key, 0))
            if key in busiest:
                usage.utilization.append(busiest[key])
            elif key in memory:  # on a GPU, but no sample since the last: idle
                usage.utilization.append(0)

    def finish(self, key: str) -> GpuTelemetry | None:
        """The attempt's figures, forgotten here; None if it was never sampled."""
        usage = self.usage.pop(key, None)
        return usage.telemetry() if usage is not None else None

    def forget(self, key: str) -> None:
        """An attempt no longer running (a sample may have come after its finish)."""
        self.usage.pop(key, None)


TEMPERATURE_GPU = 0  # pynvml's NVML_TEMPERATURE_GPU


def device_stats(nvml: Nvml, devices: Sequence[DeviceInfo]) -> list[DeviceStats]:
    """Each discovered device's utilisation, memory in use and temperature now; a figure
    NVML cannot give is None (a device it cannot reach at all has an entry of Nones)."""
    out = []
    for d in devices:
        if not d.uuid:
            continue
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(d.uuid)
        except nvml.NVMLError:
            out.append(DeviceStats(index=d.index))
            continue
        out.append(_figures(nvml, d.index, handle))
    return out


def _figures(nvml: Nvml, index: int, handle: Any) -> DeviceStats:
    def read(figure: Callable[[], Any]) -> int | None:
        try:
            return int(figure())
        except nvml.NVMLError:
            return None

    return DeviceStats(
        index=index,
        utilization=read(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
        memory_used_mb=read(lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used // 2**20),
        temperature_c=read(lambda: nvml.nvmlDeviceGetTemperature(handle, TEMPERATURE_GPU)))
