"""Whether the worker's discovered GPUs can take work: NVML cannot reach one (gone from the
bus), it has had uncorrectable ECC errors, or a card Xid error came. An unhealthy device is
reported once per reason (a DeviceHealthChanged event); the scheduler then places nothing
new on it and ends the attempt running on it as a worker failure (docs/gpus.md)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

from berth.services.worker_agent.gpus import Nvml, text
from berth.shared.messages import DeviceInfo

log = logging.getLogger("berth.worker")

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
                uuid = text(self.nvml.nvmlDeviceGetUUID(event.device))
            except self.nvml.NVMLError:
                continue
            if uuid in self.index:
                bad[self.index[uuid]] = f"Xid {xid}"

    def close(self) -> None:
        with contextlib.suppress(self.nvml.NVMLError):
            self.nvml.nvmlEventSetFree(self.events)
