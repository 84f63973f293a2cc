"""The worker's watch over its discovered GPUs, one loop beside the agent: every second it
samples what each running attempt uses (gpu_telemetry.Sampler) and each device's figures
(for the heartbeat); every GPU_HEALTH_EVERY seconds it checks their health (gpu_health) and
reports each device that turns unhealthy, once per reason."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from berth.services.worker_agent import gpu_health, gpu_telemetry
from berth.services.worker_agent.gpus import Nvml
from berth.shared.messages import DeviceInfo, DeviceStats, GpuTelemetry

log = logging.getLogger("berth.worker")

GPU_HEALTH_EVERY = 5.0  # seconds between checks of the GPUs' health
GPU_SAMPLE_EVERY = 1.0  # seconds between samples of the attempts' GPU use

# (device index, why) -> reported; raises to be retried next round.
Report = Callable[[int, str], Awaitable[None]]


class GpuWatch:
    def __init__(self, nvml: Nvml, devices: Sequence[DeviceInfo]) -> None:
        self.nvml = nvml
        self.devices = devices
        self.sampler: gpu_telemetry.Sampler | None = None  # while the watch runs
        self.stats: list[DeviceStats] = []  # the latest, sent with each heartbeat

    def finish(self, key: str) -> GpuTelemetry | None:
        """An attempt's figures for its exit report (None if never sampled)."""
        return self.sampler.finish(key) if self.sampler is not None else None

    def forget(self, key: str) -> None:
        if self.sampler is not None:
            self.sampler.forget(key)

    async def run(self, running: Callable[[], dict[int, str]], report: Report) -> None:
        """Until cancelled. `running`: supervisor pid -> attempt key of the attempts with
        GPUs running now."""
        nvml = self.nvml
        try:
            await asyncio.to_thread(nvml.nvmlInit)
        except nvml.NVMLError as exc:
            log.warning("not watching the GPUs: NVML unavailable (%s)", exc)
            return
        sampler = self.sampler = gpu_telemetry.Sampler(nvml, self.devices)
        try:
            xids: gpu_health.XidWatch | None = await asyncio.to_thread(
                gpu_health.XidWatch, nvml, self.devices)
        except nvml.NVMLError as exc:
            log.warning("not watching Xid errors: %s", exc)
            xids = None
        reported: dict[int, str] = {}
        xid_errors: dict[int, str] = {}  # events, not a state to read again: kept once seen
        checked = -GPU_HEALTH_EVERY
        try:
            while True:
                if roots := running():
                    await asyncio.to_thread(sampler.sample, roots)
                self.stats = await asyncio.to_thread(gpu_telemetry.device_stats, nvml,
                                                     self.devices)
                if time.monotonic() - checked >= GPU_HEALTH_EVERY:
                    checked = time.monotonic()
                    now = await asyncio.to_thread(gpu_health.unhealthy, nvml, self.devices)
                    if xids is not None:
                        xid_errors.update(await asyncio.to_thread(xids.drain))
                    for index, why in gpu_health.new_problems(reported,
                                                              {**xid_errors, **now}):
                        log.error("device %d is unhealthy: %s; no new attempts go to it",
                                  index, why)
                        try:
                            await report(index, why)
                        except Exception as exc:  # NATS away: retried next round
                            log.warning("reporting device %d failed (%s); retrying", index,
                                        exc)
                        else:
                            reported[index] = why
                await asyncio.sleep(GPU_SAMPLE_EVERY)
        finally:
            self.sampler = None
            if xids is not None:
                xids.close()
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlShutdown()
