"""Sends one worker's attempt reports, those made within BERTH_REPORT_COALESCE of each other
as one message (services/worker_agent/report_batch.py says which and how)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import msgspec

from berth.services.worker_agent import report_batch
from berth.shared.messages import AttemptReported

# Publishes an event with a dedup id, retried until stored; returns its stream sequence
# (nats_io.EventPublisher.publish).
Publish = Callable[[str, msgspec.Struct, str], Awaitable[int]]


class ReportSender:
    def __init__(self, worker_id: str, subject: str, window: float, publish: Publish) -> None:
        self.worker_id = worker_id
        self.subject = subject
        self.window = window
        self.publish = publish
        self.waiting: list[tuple[AttemptReported, asyncio.Future[int]]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.last_sent: float | None = None  # the event loop's clock
        self.last_batch: list[tuple[AttemptReported, asyncio.Future[int]]] = []
        self.sending: set[asyncio.Task[None]] = set()
        self.messages = 0  # messages sent, for the tests and the benchmark

    async def send(self, report: AttemptReported) -> int:
        """Returns once `report` is stored: its message's stream sequence."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        self.waiting.append((report, done))
        if self.timer is None:
            now = loop.time()
            # The last message carried only this attempt and is stored: its futures are
            # done (not `sending`: the publish task ends a loop turn after they are set, and
            # an exit already known is reported in the turn its RUNNING returns).
            attempt = report_batch.attempt_of(report)
            alone = bool(self.last_batch) and all(
                stored.done() and report_batch.attempt_of(last) == attempt
                for last, stored in self.last_batch)
            at = report_batch.send_at(now, self.last_sent, self.window, alone)
            if at <= now:
                self._flush()
            else:
                self.timer = loop.call_at(at, self._flush)
        return await done

    def _flush(self) -> None:
        self.timer = None
        batch, self.waiting = self.waiting, []
        if not batch:
            return
        self.last_sent = asyncio.get_running_loop().time()
        self.last_batch = batch
        task = asyncio.create_task(self._publish(batch))
        self.sending.add(task)
        task.add_done_callback(self.sending.discard)

    async def _publish(self, batch: list[tuple[AttemptReported, asyncio.Future[int]]]) -> None:
        reports = [r for r, _ in batch]
        start = 0
        try:
            for event, msg_id, count in report_batch.messages(self.worker_id, reports,
                                                              time.time()):
                part = batch[start:start + count]
                start += count
                self.messages += 1
                try:
                    seq = await self.publish(self.subject, event, msg_id)
                except Exception as exc:  # not retriable: each report's sender hears of it
                    for _, done in part:
                        if not done.done():
                            done.set_exception(exc)
                    continue
                for _, done in part:
                    if not done.done():
                        done.set_result(seq)
        finally:
            for _, done in batch:  # never leave a sender waiting for ever
                if not done.done():
                    done.set_exception(RuntimeError("attempt report not sent"))
