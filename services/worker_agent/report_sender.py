"""Sends one worker's attempt reports, those made within BERTH_REPORT_COALESCE of each other
as one message (services/worker_agent/report_batch.py says which and how)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import msgspec

from berth.services.worker_agent import report_batch
from berth.shared.messages import AttemptReported

# Publishes an event with a dedup id, retried until stored; its stream sequence, awaited
# (nats_io.EventPublisher.submit returns it as a future, so no task is started per message;
# a coroutine, e.g. EventPublisher.publish, works too).
Publish = Callable[[str, msgspec.Struct, str], Awaitable[int]]
# Publishes as `Publish` does, settling the future given (EventPublisher.submit's `done`).
PublishInto = Callable[[str, msgspec.Struct, str, "asyncio.Future[int]"], object]
Batch = list[tuple[AttemptReported, asyncio.Future[int]]]


class ReportSender:
    def __init__(self, worker_id: str, subject: str, window: float, publish: Publish,
                 publish_into: PublishInto | None = None) -> None:
        """`publish_into`: the same publisher, settling a future it is given. A message of
        one report then settles that report's own future: no future, callback and wake-up
        more per report (most messages carry one; docs/performance.md)."""
        self.worker_id = worker_id
        self.subject = subject
        self.window = window
        self.publish = publish
        self.publish_into = publish_into
        self.waiting: Batch = []
        self.timer: asyncio.TimerHandle | None = None
        self.last_sent: float | None = None  # the event loop's clock
        self.last_batch: Batch = []
        self.messages = 0  # messages sent, for the tests and the benchmark

    async def send(self, report: AttemptReported) -> int:
        """Returns once `report` is stored: its message's stream sequence."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        self.waiting.append((report, done))
        if self.timer is None:
            now = loop.time()
            # The last message carried only this attempt and is stored: its futures are
            # done (an exit already known is reported in the turn its RUNNING returns).
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
        reports = [r for r, _ in batch]
        self._send(batch, report_batch.messages(self.worker_id, reports, time.time()), 0, 0)

    def _send(self, batch: Batch, messages: list[tuple[msgspec.Struct, str, int]], index: int,
              start: int) -> None:
        """Sends message `index` of the batch's `messages` (carrying its reports from
        `start` on), and the next once it is stored or refused: in order, one at a time.
        Every report's sender hears of its message, stored or not: none waits for ever."""
        if index == len(messages):
            return
        event, msg_id, count = messages[index]
        part = batch[start:start + count]
        self.messages += 1
        if self.publish_into is not None and len(messages) == 1 and count == 1:
            try:
                self.publish_into(self.subject, event, msg_id, part[0][1])
            except Exception as exc:  # not retriable: the report's sender hears of it
                _settle(part, None, exc)
            return
        try:
            stored = asyncio.ensure_future(self.publish(self.subject, event, msg_id))
        except Exception as exc:  # not retriable: each report's sender hears of it
            _settle(part, None, exc)
            self._send(batch, messages, index + 1, start + count)
            return

        def sent(stored: asyncio.Future[int]) -> None:
            if stored.cancelled():
                _settle(part, None, RuntimeError("attempt report not sent"))
            elif (exc := stored.exception()) is not None:
                _settle(part, None, exc)
            else:
                _settle(part, stored.result(), None)
            self._send(batch, messages, index + 1, start + count)

        stored.add_done_callback(sent)


def _settle(part: Batch, seq: int | None, exc: BaseException | None) -> None:
    for _, done in part:
        if done.done():
            continue
        if exc is not None:
            done.set_exception(exc)
        else:
            assert seq is not None
            done.set_result(seq)
