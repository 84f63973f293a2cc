"""The worker's GPUs: discovered through NVML (NVIDIA's own binding, `nvidia-ml-py`, imported
as `pynvml`), or taken from `--gpu VARIANT:COUNT` where NVML finds none.

NVML sits behind `Nvml`, the few calls used here, so tests can hand in a fake; what a user
runs always gets the real binding. No NVML library or driver on the host means no GPUs,
never an error: most hosts have none."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from berth.services.worker_agent.device_offer import GPU, offered_devices
from berth.shared.messages import DeviceInfo

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
                index=index, uuid=text(nvml.nvmlDeviceGetUUID(handle)),
                model=text(nvml.nvmlDeviceGetName(handle)),
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


def text(value: str | bytes) -> str:
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


def offered(gpus: Gpus, flag: tuple[str, int] | None) -> tuple[str, tuple[DeviceInfo, ...]]:
    """The (variant, devices) a worker offers: what NVML discovered, or `flag`'s
    (variant, count) under device_offer's rule."""
    if flag is None:
        return gpus.variant, gpus.devices
    variant, count = flag
    return variant, offered_devices(GPU, f"--gpu {variant}:{count}", variant, count,
                                    gpus.variant, gpus.devices, gpus.note)


def describe(devices: Sequence[DeviceInfo]) -> str:
    """One line for the registration log."""
    if not devices:
        return "no GPU"
    first = devices[0]
    what = first.model or "unchecked"
    memory = f", {first.memory_mb} MiB each" if first.memory_mb else ""
    return f"{len(devices)} GPU{'s' if len(devices) != 1 else ''} ({what}{memory})"
