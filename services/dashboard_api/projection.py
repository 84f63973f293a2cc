"""Keeps a ClusterState folded from the events stream, plus worker heartbeats."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared import nats_io, subjects
from shared.lifecycle import ClusterState
from shared.messages import heartbeat_decoder

log = logging.getLogger("berth.dashboard.projection")


class Projection:
    def __init__(self, nc: NATS, worker_dead_after: float) -> None:
        self.nc = nc
        self.state = ClusterState()
        self.last_heartbeat: dict[str, float] = {}
        self.worker_dead_after = worker_dead_after
        self.changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.nc.subscribe(subjects.HEARTBEATS_ALL, cb=self._on_heartbeat)
        self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()

    async def _follow(self) -> None:
        async for record in nats_io.follow_events(self.nc.jetstream()):
            self.state.apply(record.seq, record.event)
            async with self.changed:
                self.changed.notify_all()

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = heartbeat_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        self.last_heartbeat[hb.worker_id] = hb.ts

    def worker_healthy(self, worker_id: str) -> bool:
        worker = self.state.workers.get(worker_id)
        seen = self.last_heartbeat.get(worker_id)
        return bool(worker and worker.alive and seen
                    and time.time() - seen < self.worker_dead_after)
