"""Attempt reports coalesced per worker (BERTH_REPORT_COALESCE): which go out together and as
what (pure rules), the sender's timing over a recording publisher, who is believed, and a
batch stored once on a real nats-server however often its publish is retried."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from nats.aio.client import Client as NATS

from berth.services.worker_agent import report_batch
from berth.services.worker_agent.report_sender import ReportSender
from berth.shared import nats_io, subjects
from berth.shared.config import Settings
from berth.shared.event_origin import RefusedEvent, read_event
from berth.shared.messages import AttemptReported, AttemptsReported, encode, reports_in
from berth.shared.states import TaskState

S = TaskState
W = "w1"


def rep(attempt: int, state: TaskState = S.RUNNING, worker: str = W, error: str = ""
        ) -> AttemptReported:
    return AttemptReported(job_id="j1", task_index=0, attempt_id=attempt, worker_id=worker,
                           state=state, error=error)


@pytest.mark.parametrize(
    ("now", "last_sent", "window", "at"),
    [
        (10.0, None, 0.002, 10.0),  # the first report ever: at once
        (10.0, 9.0, 0.002, 10.0),  # none sent lately: a lone report waits for nothing
        (10.0, 9.998, 0.002, 10.0),  # exactly a window later: at once
        (10.0, 9.999, 0.002, 10.001),  # one sent 1 ms ago: waits out the window's rest
        (10.0, 10.0, 0.002, 10.002),  # at most the whole window, never more
        (10.0, 10.0, 0.0, 10.0),  # 0 turns coalescing off
        (10.0, 10.0, -1.0, 10.0),
    ],
)
def test_when_a_report_goes_out(now: float, last_sent: float | None, window: float,
                                at: float) -> None:
    assert report_batch.send_at(now, last_sent, window) == pytest.approx(at)
    # Following only its own attempt's stored message (a lone task's exit), at once.
    assert report_batch.send_at(now, last_sent, window, alone=True) == now


def test_a_run_of_one_is_the_plain_report_and_a_longer_one_a_batch() -> None:
    [(event, msg_id, count)] = report_batch.messages(W, [rep(1, S.SUCCEEDED)], ts=5.0)
    assert event == rep(1, S.SUCCEEDED) and count == 1
    assert msg_id == "report:j1/0/1:SUCCEEDED"  # the id a report always had
    reports = [rep(1), rep(2), rep(1, S.SUCCEEDED)]
    [(batch, batch_id, count)] = report_batch.messages(W, reports, ts=5.0)
    assert batch == AttemptsReported(worker_id=W, reports=reports, ts=5.0) and count == 3
    assert reports_in(batch) == reports
    # The same entries, the same id (a retried publish is a duplicate); others, another.
    assert batch_id == report_batch.batch_id(W, list(reports))
    assert batch_id != report_batch.batch_id(W, reports[:2])
    assert batch_id != report_batch.batch_id(W, [reports[1], reports[0], reports[2]])
    assert batch_id != report_batch.batch_id("w2", reports)


def test_a_batch_over_the_size_bound_is_split_in_order() -> None:
    reports = [rep(i, error="x" * 400) for i in range(10)]
    size = len(encode(reports[0]))
    out = report_batch.messages(W, reports, ts=0.0, max_bytes=3 * size)
    assert [count for _, _, count in out] == [3, 3, 3, 1]
    assert [r for event, _, _ in out for r in reports_in(event)] == reports
    assert isinstance(out[-1][0], AttemptReported)
    assert len({msg_id for _, msg_id, _ in out}) == 4


class Recorder:
    """Stands in for the stream: records what is published when, acks with a sequence."""

    def __init__(self, fail: bool = False) -> None:
        self.sent: list[tuple[float, msgspec.Struct, str]] = []
        self.fail = fail

    async def publish(self, subject: str, event: msgspec.Struct, msg_id: str) -> int:
        assert subject == subjects.attempt_reports(W)
        if self.fail:
            raise RuntimeError("no stream")
        self.sent.append((asyncio.get_running_loop().time(), event, msg_id))
        await asyncio.sleep(0)
        return len(self.sent)


async def test_reports_made_within_the_window_go_out_as_one_message_none_waiting_longer(
        ) -> None:
    window = 0.05
    recorder = Recorder()
    sender = ReportSender(W, subjects.attempt_reports(W), window, recorder.publish)
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await sender.send(rep(0)) == 1  # lone: at once
    assert recorder.sent[0][0] - start < window / 2
    # Three more within the window of the first: one message, when that window ends.
    seqs = await asyncio.gather(sender.send(rep(1)), sender.send(rep(2)),
                                sender.send(rep(0, S.SUCCEEDED)))
    assert seqs == [2, 2, 2]
    when, batch, _ = recorder.sent[1]
    assert reports_in(batch) == [rep(1), rep(2), rep(0, S.SUCCEEDED)]
    assert window * 0.9 <= when - recorder.sent[0][0] <= window * 3
    # A quiet spell later, a lone report goes at once again.
    await asyncio.sleep(window)
    before = loop.time()
    await sender.send(rep(3))
    assert recorder.sent[2][0] - before < window / 2 and sender.messages == 3


async def test_a_lone_tasks_exit_right_after_its_running_waits_for_no_window() -> None:
    """A task that exits within the window of its own RUNNING (`true` on a fast host) had
    its exit held for the rest of the window: no other report was there to join it."""
    window = 0.2
    recorder = Recorder()
    sender = ReportSender(W, subjects.attempt_reports(W), window, recorder.publish)
    loop = asyncio.get_running_loop()
    await sender.send(rep(0))
    before = loop.time()  # stored; its exit made at once (the process ended meanwhile)
    await sender.send(rep(0, S.SUCCEEDED))
    assert loop.time() - before < window / 4 and sender.messages == 2
    # Another attempt's report after it still waits out the window, and reports made
    # meanwhile share its message, the first attempt's included.
    started = loop.time()
    seqs = await asyncio.gather(sender.send(rep(1)), sender.send(rep(0, S.KILLED)))
    assert seqs == [3, 3] and loop.time() - started >= window / 2
    # An attempt whose last report went out with another's waits too: a message was not
    # its own.
    started = loop.time()
    await sender.send(rep(1, S.SUCCEEDED))
    assert loop.time() - started >= window / 2 and sender.messages == 4


async def test_with_coalescing_off_each_report_is_its_own_message() -> None:
    recorder = Recorder()
    sender = ReportSender(W, subjects.attempt_reports(W), 0.0, recorder.publish)
    await asyncio.gather(*(sender.send(rep(i)) for i in range(4)))
    assert [event for _, event, _ in recorder.sent] == [rep(i) for i in range(4)]


async def test_a_batch_over_one_message_goes_out_as_several_in_order_one_at_a_time(
        ) -> None:
    recorder = Recorder()
    in_flight: list[int] = []

    async def publish(subject: str, event: msgspec.Struct, msg_id: str) -> int:
        in_flight.append(1)
        assert len(in_flight) == 1  # the next waits until this one is stored
        await asyncio.sleep(0.01)
        in_flight.pop()
        return await recorder.publish(subject, event, msg_id)

    sender = ReportSender(W, subjects.attempt_reports(W), 0.05, publish)
    await sender.send(rep(0))
    # ~300 reports of ~2,000 bytes each made within one window: more than one message holds.
    many = [rep(i, S.FAILED, error="x" * 2000) for i in range(1, 301)]
    seqs = await asyncio.gather(*(sender.send(r) for r in many))
    carried = [reports_in(event) for _, event, _ in recorder.sent[1:]]
    assert len(carried) >= 2
    assert [r for batch in carried for r in batch] == many  # each once, in order
    # Each report heard of the message that carried it.
    expected = [n + 2 for n, batch in enumerate(carried) for _ in batch]
    assert seqs == expected


async def test_a_failed_publish_is_heard_by_every_report_it_carried() -> None:
    sender = ReportSender(W, subjects.attempt_reports(W), 0.01, Recorder(fail=True).publish)
    results = await asyncio.gather(*(sender.send(rep(i)) for i in range(3)),
                                   return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)


def test_a_batch_is_believed_only_from_its_workers_subject_naming_only_that_worker() -> None:
    mine = AttemptsReported(worker_id=W, reports=[rep(1), rep(2)])
    assert read_event(subjects.attempt_reports(W), encode(mine)) == mine
    with pytest.raises(RefusedEvent, match="AttemptsReported may not come from"):
        read_event(subjects.attempt_reports("w2"), encode(mine))
    # One entry about another worker's attempt spoils the whole message.
    smuggled = AttemptsReported(worker_id=W, reports=[rep(1), rep(2, worker="w2")])
    with pytest.raises(RefusedEvent):
        read_event(subjects.attempt_reports(W), encode(smuggled))


async def test_a_batch_is_stored_once_however_often_its_publish_is_retried(nc: NATS) -> None:
    js = nc.jetstream()
    publisher = nats_io.EventPublisher(js)
    sender = ReportSender(W, subjects.attempt_reports(W), 0.05, publisher.publish)
    first = await sender.send(rep(0))
    second = await asyncio.gather(sender.send(rep(1)), sender.send(rep(2)))
    assert len(set(second)) == 1 and second[0] > first
    # The same batch again (a publish whose ack was lost, retried): the stream keeps one.
    reports = [rep(1), rep(2)]
    [(batch, msg_id, _)] = report_batch.messages(W, reports, ts=0.0)
    again = await nats_io.publish_event(js, subjects.attempt_reports(W), batch, msg_id)
    assert again == second[0]
    last = await nats_io.last_event_seq(js)
    assert last == second[0]
    seen = []
    async for record in nats_io.follow_events(js):
        seen += reports_in(record.event)
        if record.seq >= last:
            break
    assert [(r.attempt_id, r.state) for r in seen] == [(0, S.RUNNING), (1, S.RUNNING),
                                                       (2, S.RUNNING)]


@pytest.mark.parametrize(("raw", "value"), [("", 0.002), ("0", 0.0), ("0.01", 0.01)])
def test_the_window_setting(monkeypatch: pytest.MonkeyPatch, raw: str, value: float) -> None:
    monkeypatch.setenv("BERTH_REPORT_COALESCE", raw)
    assert Settings.from_env().report_coalesce == value


@pytest.mark.parametrize("raw", ["-0.001", "5", "soon"])
def test_a_bad_window_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("BERTH_REPORT_COALESCE", raw)
    with pytest.raises(SystemExit, match=r"^BERTH_REPORT_COALESCE="):
        Settings.from_env()


async def test_a_message_of_one_report_settles_that_reports_own_future(nc: NATS) -> None:
    publisher = nats_io.EventPublisher(nc.jetstream())
    alone: list[msgspec.Struct] = []

    def publish_into(subject: str, event: msgspec.Struct, msg_id: str,
                     done: asyncio.Future[int]) -> None:
        alone.append(event)
        assert publisher.submit(subject, event, msg_id, done=done) is done

    sender = ReportSender(W, subjects.attempt_reports(W), 0.05, publisher.publish, publish_into)
    first = await sender.send(rep(0))
    # Two within the window: one message carrying both, through `publish`.
    seqs = await asyncio.gather(sender.send(rep(1)), sender.send(rep(2)))
    assert alone == [rep(0)] and seqs[0] == seqs[1] > first
    assert await nats_io.last_event_seq(nc.jetstream()) == seqs[0]

    def refused(subject: str, event: msgspec.Struct, msg_id: str,
                done: asyncio.Future[int]) -> None:
        raise RuntimeError("no stream")

    failing = ReportSender(W, subjects.attempt_reports(W), 0.05, publisher.publish, refused)
    with pytest.raises(RuntimeError, match="no stream"):
        await failing.send(rep(3))
