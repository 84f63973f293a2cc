"""The worker's GPUs: discovered through NVML (NVIDIA's own binding, `nvidia-ml-py`, imported
as `pynvml`), or taken from `--gpu VARIANT:COUNT` where NVML finds none.

NVML sits behind `Nvml`, the few calls used here, so tests can hand in a fake; what a user
runs always gets the real binding. No NVML library or driver on the host means no GPUs,
never an error: most hosts have none."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.messages import DeviceInfo, DeviceStats, GpuTelemetry

log = logging.getLogger("berth.worker")

# NVML's model name -> the variant a job asks for (`device: {type: gpu, variant: h100}`).
# Matched in order, as whole words of the lower-cased name, so "H100 NVL" and
# "H100 80GB HBM3" are both h100 and "A100-SXM4-80GB" is a100. A model not in the table
# gets the fallback: its name lower-cased, "NVIDIA " dropped, runs of other characters
# made "-" ("NVIDIA RTX 6000 Ada Generation" -> "rtx-6000-ada-generation").
VARIANTS: tuple[tuple[str, str], ...] = (
    ("gb200", "gb200"),
    ("b200", "b200"),
    ("b100", "b100"),
    ("gh200", "gh200"),
    ("h200", "h200"),
    ("h100", "h100"),
    ("h800", "h800"),
    ("h20", "h20"),
    ("a100", "a100"),
    ("a800", "a800"),
    ("a40", "a40"),
    ("a30", "a30"),
    ("a10g", "a10g"),
    ("a10", "a10"),
    ("l40s", "l40s"),
    ("l40", "l40"),
    ("l4", "l4"),
    ("t4", "t4"),
    ("v100", "v100"),
    ("p100", "p100"),
)


def variant_of(model: str) -> str:
    """The variant of an NVML model name (VARIANTS, else the fallback)."""
    words = set(re.split(r"[^a-z0-9]+", model.lower()))
    for word, variant in VARIANTS:
        if word in words:
            return variant
    name = re.sub(r"^nvidia[^a-z0-9]*", "", model.lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-")[:63] or "gpu"


class Nvml(Protocol):
    """The part of pynvml berth calls (same names, same meaning)."""

    NVMLError: type[Exception]

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str: ...
    def nvmlDeviceGetName(self, handle: Any) -> str: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...  # .total in bytes
    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...  # .gpu in percent
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
    def nvmlEventSetCreate(self) -> Any: ...
    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, events: Any) -> None: ...
    # An item with .device (a handle), .eventType and .eventData (the Xid); raises an
    # NVMLError (Timeout) when no event comes within `timeout_ms`.
    def nvmlEventSetWait_v2(self, events: Any, timeout_ms: int) -> Any: ...
    def nvmlEventSetFree(self, events: Any) -> None: ...
    # Items with .pid and .usedGpuMemory (bytes, None where NVML cannot tell).
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]: ...
    # Items with .pid and .smUtil (percent) for samples newer than `since` (microseconds).
    def nvmlDeviceGetProcessUtilization(self, handle: Any, since: int) -> list[Any]: ...
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter: int
                                    ) -> int: ...


def real_nvml() -> Nvml | None:
    """The real binding, or None where the package is not installed."""
    try:
        import pynvml  # type: ignore[import-untyped]  # the binding ships no type hints
    except ImportError:
        return None
    binding: Nvml = pynvml
    return binding


@dataclass(frozen=True)
class Gpus:
    """What NVML found: the devices, their variant ("" if none), or why there are none."""

    devices: tuple[DeviceInfo, ...] = ()
    variant: str = ""
    note: str = ""


def discover(nvml: Nvml | None) -> Gpus:
    """Every GPU NVML reports, in NVML index order. A host with GPUs of several models
    offers the variant of the first and only the devices of that variant (a worker offers
    one device kind; run one worker per model to offer the others)."""
    if nvml is None:
        return Gpus(note="nvidia-ml-py is not installed")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return Gpus(note=f"NVML unavailable: {exc}")
    try:
        found = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            found.append(DeviceInfo(
                index=index, uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                model=_text(nvml.nvmlDeviceGetName(handle)),
                memory_mb=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // (1024 * 1024)))
    except nvml.NVMLError as exc:
        return Gpus(note=f"NVML failed while listing devices: {exc}")
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()
    if not found:
        return Gpus(note="NVML reports no GPUs")
    variant = variant_of(found[0].model)
    same = tuple(d for d in found if variant_of(d.model) == variant)
    if len(same) < len(found):
        others = sorted({d.model for d in found} - {found[0].model})
        log.warning("offering only the %d %s GPUs; also found %s (run a worker per model)",
                    len(same), variant, ", ".join(others))
    return Gpus(same, variant)


def _text(value: str | bytes) -> str:
    # Older bindings return bytes.
    return value.decode() if isinstance(value, bytes) else value


def restrict(gpus: Gpus, visible: str | None) -> Gpus:
    """Only the devices the worker's own CUDA_VISIBLE_DEVICES lists (indices or UUIDs), when
    it is set: an operator may give a worker part of a host."""
    if visible is None:
        return gpus
    wanted = {v.strip() for v in visible.split(",") if v.strip()}
    kept = tuple(d for d in gpus.devices if str(d.index) in wanted or d.uuid in wanted)
    return Gpus(kept, gpus.variant if kept else "", gpus.note)


class OfferError(ValueError):
    """A --gpu flag that asks for what the host does not have (one line, for the user)."""


def offered(gpus: Gpus, flag: tuple[str, int] | None) -> tuple[str, tuple[DeviceInfo, ...]]:
    """The (variant, devices) a worker offers: what was discovered, or `flag`'s
    (variant, count). Where NVML found nothing, the flag's devices are numbered 0..COUNT-1
    (with a warning: nothing checks they exist); where it found GPUs, the flag may offer
    fewer of them (the first COUNT) but not more, nor another variant."""
    if flag is None:
        return gpus.variant, gpus.devices
    variant, count = flag
    if count < 1:
        raise OfferError(f"--gpu {variant}:{count}: COUNT must be at least 1")
    if not gpus.devices:
        log.warning("--gpu %s:%d: no GPU discovered (%s); offering devices 0..%d unchecked",
                    variant, count, gpus.note or "none found", count - 1)
        return variant, tuple(DeviceInfo(index=i) for i in range(count))
    if count > len(gpus.devices):
        raise OfferError(f"--gpu {variant}:{count}: asks for {count} GPUs, NVML found "
                         f"{len(gpus.devices)} ({gpus.devices[0].model})")
    if variant != gpus.variant:
        raise OfferError(f"--gpu {variant}:{count}: NVML found {gpus.variant} GPUs "
                         f"({gpus.devices[0].model}), not {variant}")
    return variant, gpus.devices[:count]


def describe(devices: Sequence[DeviceInfo]) -> str:
    """One line for the registration log."""
    if not devices:
        return "no GPU"
    first = devices[0]
    what = first.model or "unchecked"
    memory = f", {first.memory_mb} MiB each" if first.memory_mb else ""
    return f"{len(devices)} GPU{'s' if len(devices) != 1 else ''} ({what}{memory})"


# pynvml's NVML_MEMORY_ERROR_TYPE_UNCORRECTED and NVML_VOLATILE_ECC (since the driver loaded).
UNCORRECTED = 1
VOLATILE = 0


def unhealthy(nvml: Nvml, devices: Sequence[DeviceInfo]) -> dict[int, str]:
    """The discovered devices that should take no new attempts, and why: NVML cannot reach
    one (gone from the bus, lost), or it has had uncorrectable ECC errors since the driver
    loaded. Devices without a UUID (offered by --gpu, unchecked) are not checked. NVML must
    be initialised (nvmlInit) by the caller."""
    bad: dict[int, str] = {}
    for d in devices:
        if not d.uuid:
            continue
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(d.uuid)
        except nvml.NVMLError as exc:
            bad[d.index] = f"NVML cannot reach {d.uuid}: {exc}"
            continue
        try:
            errors = nvml.nvmlDeviceGetTotalEccErrors(handle, UNCORRECTED, VOLATILE)
        except nvml.NVMLError:
            continue  # no ECC on this model, or not readable: nothing to judge by
        if errors:
            bad[d.index] = f"{errors} uncorrectable ECC errors"
    return bad


def new_problems(reported: dict[int, str], now: dict[int, str]) -> list[tuple[int, str]]:
    """(index, reason) for each device unhealthy now for a reason not reported yet. A
    device that looks well again is not reported healthy: a card that failed once is
    returned to service by an operator (`berth device enable`)."""
    return [(i, why) for i, why in sorted(now.items()) if reported.get(i) != why]


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


XID_EVENTS = 0x8  # pynvml's nvmlEventTypeXidCriticalError
# Xids a user's program causes (an illegal address, an MMU fault, a killed context...), not
# the card: NVIDIA's Kubernetes device plugin skips the same ones by default.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


class XidWatch:
    """Xid errors NVML reports for the worker's discovered GPUs, collected without blocking.
    NVML must be initialised."""

    def __init__(self, nvml: Nvml, devices: Sequence[DeviceInfo]) -> None:
        self.nvml = nvml
        self.index = {d.uuid: d.index for d in devices if d.uuid}
        self.events = nvml.nvmlEventSetCreate()
        for uuid in self.index:
            try:
                nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByUUID(uuid),
                                              XID_EVENTS, self.events)
            except nvml.NVMLError as exc:
                log.warning("no Xid events from %s: %s", uuid, exc)

    def drain(self) -> dict[int, str]:
        """The devices with a card Xid since the last drain, and which."""
        bad: dict[int, str] = {}
        while True:
            try:
                event = self.nvml.nvmlEventSetWait_v2(self.events, 0)
            except self.nvml.NVMLError:
                return bad  # none waiting (Timeout)
            xid = int(event.eventData)
            if xid in APPLICATION_XIDS:
                continue
            try:
                uuid = _text(self.nvml.nvmlDeviceGetUUID(event.device))
            except self.nvml.NVMLError:
                continue
            if uuid in self.index:
                bad[self.index[uuid]] = f"Xid {xid}"

    def close(self) -> None:
        with contextlib.suppress(self.nvml.NVMLError):
            self.nvml.nvmlEventSetFree(self.events)
