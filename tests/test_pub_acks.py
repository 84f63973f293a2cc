"""JetStream's replies to berth's publishes, settled in the read loop (shared/pub_acks.py,
`nats_io.Client.publish_stored_batch`): each reply settles its own publish with the stream
sequence or the error nats-py raises for it, and a refused publish is retried at once,
not after nats-py's publish_async left it to time out."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats.errors
import nats.js.errors
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NATS

from berth.shared import nats_io, pub_acks, subjects
from berth.shared.messages import AttemptReported, TaskState, encode

NO_RESPONDERS = b"NATS/1.0 503\r\n\r\n"


def one_publish(acks: pub_acks.PendingAcks) -> tuple[bytes, pub_acks.AckBatch]:
    """A lone publish: a batch of one, as `nats_io.publish_to_stream` sends it."""
    batch = acks.batch(1)
    return acks.expect_in(batch), batch


@pytest.mark.parametrize(("headers", "data", "expected"), [
    (None, b'{"stream":"events","seq":42}', 42),
    (None, b'{"stream":"events","seq":42,"duplicate":true}', 42),
    (None, b'{"stream":"events","seq":7,"domain":"hub","val":"3"}', 7),  # fields berth ignores
    (NO_RESPONDERS, b"", nats.js.errors.NoStreamResponseError),
    (None, b'{"error":{"code":503,"err_code":10077,"description":"unavailable"}}',
     nats.js.errors.ServiceUnavailableError),
    (None, b'{"error":{"code":409,"err_code":10158,"description":"duplicate message id is '
           b'in process"}}', nats.js.errors.APIError),
    (None, b'{"error":{"code":400,"err_code":10060,"description":"expected stream does not '
           b'match"}}', nats.js.errors.BadRequestError),
    (None, b'{"error":{"code":500,"description":"x","extra":1}}', nats.js.errors.ServerError),
    (None, b'{"error":{"code":404,"err_code":10059,"description":"stream not found"}}',
     nats.js.errors.NotFoundError),
    (None, b"not json", pub_acks.UnreadableReply),
    (None, b'{"seq":"forty"}', pub_acks.UnreadableReply),
    (None, b'{}', pub_acks.UnreadableReply),  # neither a sequence nor an error
    (None, b'{"stream":"events","seq":0}', pub_acks.UnreadableReply),
])
async def test_a_reply_settles_its_publish(headers: bytes | None, data: bytes,
                                           expected: int | type[BaseException]) -> None:
    acks = pub_acks.PendingAcks()
    token, batch = one_publish(acks)
    acks.take(token, headers, data)
    assert batch.done.done() and len(acks) == 0
    [error] = batch.outcomes
    if isinstance(expected, int):
        assert error == expected
        return
    assert type(error) is expected, error
    if isinstance(error, nats.js.errors.APIError) and b"err_code" in data:
        assert str(error.err_code) in data.decode()  # nats-py's fields, as it reads them


@settings(max_examples=300)
@given(st.one_of(st.none(), st.binary(max_size=40)),
       st.one_of(st.binary(max_size=80), st.sampled_from([
           b'{"error":{}}', b'{"error":{"code":"x"}}', b'{"error":null,"seq":1}',
           b'{"seq":-1}', b'{"seq":1e3}', b'[]', b'{"error":[]}'])))
def test_any_reply_settles_its_publish_and_raises_nothing(headers: bytes | None,
                                                          data: bytes) -> None:
    async def check() -> None:
        acks = pub_acks.PendingAcks()
        token, batch = one_publish(acks)
        acks.take(token, headers, data)  # whatever came on the inbox: no exception here
        assert batch.done.done()
        [result] = batch.outcomes
        assert isinstance(result, (int, BaseException))

    asyncio.run(check())


async def test_each_reply_settles_only_its_own_publish() -> None:
    acks = pub_acks.PendingAcks()
    (one, first), (two, second) = one_publish(acks), one_publish(acks)
    assert one != two
    acks.take(two, None, b'{"seq":2}')
    assert not first.done.done() and second.outcomes == [2]
    acks.take(b"unknown", None, b'{"seq":9}')  # a reply nobody waits for: nothing happens
    acks.take(two, None, b'{"seq":3}')  # nor does a second reply to a settled one
    assert second.outcomes == [2] and first.outcomes == [None] and len(acks) == 1


async def test_a_batch_settles_each_publish_from_its_own_reply() -> None:
    acks = pub_acks.PendingAcks()
    batch = acks.batch(3)
    tokens = [acks.expect_in(batch) for _ in range(3)]
    acks.take(tokens[2], None, b'{"seq":12}')
    acks.take(tokens[0], NO_RESPONDERS, b"")
    assert not batch.done.done() and batch.left == 1
    acks.take(tokens[2], None, b'{"seq":99}')  # a second reply changes nothing
    acks.take(tokens[1], None, b'{"seq":11}')
    await batch.wait(5)
    assert isinstance(batch.outcomes[0], nats.js.errors.NoStreamResponseError)
    assert batch.outcomes[1:] == [11, 12] and len(acks) == 0 and not batch.unsent


async def test_a_batch_stops_waiting_and_forgets_what_went_unanswered() -> None:
    acks = pub_acks.PendingAcks()
    batch = acks.batch(3)
    first, second, _third = (acks.expect_in(batch) for _ in range(3))
    acks.take(first, None, b'{"seq":1}')
    batch.not_sent(2, nats.errors.ConnectionClosedError())
    started = time.monotonic()
    await batch.wait(0.05)
    assert time.monotonic() - started < 1
    assert batch.outcomes[0] == 1 and isinstance(batch.outcomes[1], TimeoutError)
    assert isinstance(batch.outcomes[2], nats.errors.ConnectionClosedError)
    assert batch.unsent == {2} and len(acks) == 0
    acks.take(second, None, b'{"seq":2}')  # too late: passed over
    assert isinstance(batch.outcomes[1], TimeoutError)
    empty = acks.batch(0)
    await empty.wait(5)
    assert empty.outcomes == [] and empty.done.done()


async def test_a_batch_whose_waiter_is_cancelled_is_forgotten() -> None:
    acks = pub_acks.PendingAcks()
    batch = acks.batch(2)
    for _ in range(2):
        acks.expect_in(batch)
    waiter = asyncio.create_task(batch.wait(5))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert len(acks) == 0


async def test_a_batch_on_a_real_server_gets_its_sequences_and_refusals(nc: NATS) -> None:
    assert isinstance(nc, nats_io.Client)
    reports = subjects.attempt_reports("w1")
    batch = await nc.publish_stored_batch(
        [(reports, report(1), {"Nats-Msg-Id": "b1"}),
         (subjects.SUBMIT_JOB, b"{}", {"Nats-Msg-Id": "b2"}),  # another stream's subject
         ("berth-test.nowhere", b"{}", {"Nats-Msg-Id": "b3"}),  # no stream's
         (reports, report(2), {"Nats-Msg-Id": "b4"})], subjects.EVENTS_STREAM)
    await batch.wait(5)
    first, wrong, nowhere, last = batch.outcomes
    assert isinstance(first, int) and isinstance(last, int) and last == first + 1
    assert isinstance(wrong, nats.js.errors.BadRequestError)
    assert isinstance(nowhere, nats.js.errors.NoStreamResponseError)


async def test_a_batch_cancelled_while_publishing_is_forgotten(
        nc: NATS, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(nc, nats_io.Client)
    await nats_io.publish_to_stream(
        nc, [(subjects.attempt_reports("w1"), report(0), {"Nats-Msg-Id": "c0"})],
        subjects.EVENTS_STREAM)
    # (the reply subscription, made)
    sent: list[str] = []
    second = asyncio.Event()
    publish = nc.publish

    async def slow_second(subject: str, payload: bytes = b"", reply: str = "",
                          headers: dict[str, str] | None = None) -> None:
        sent.append(subject)
        if len(sent) == 2:
            second.set()
            await asyncio.sleep(10)  # a full pending buffer, say
        await publish(subject, payload, reply, headers)

    monkeypatch.setattr(nc, "publish", slow_second)
    batch = asyncio.create_task(nc.publish_stored_batch(
        [(subjects.attempt_reports("w1"), report(i), {"Nats-Msg-Id": f"c{i}"})
         for i in range(1, 4)], subjects.EVENTS_STREAM))
    await asyncio.wait_for(second.wait(), 5)
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    await asyncio.sleep(0.2)  # the first one's reply, had it been kept, has come by now
    assert len(nc._acks) == 0


def report(attempt: int) -> bytes:
    return encode(AttemptReported(job_id="j1-0001", task_index=0, attempt_id=attempt,
                                  worker_id="w1", state=TaskState.RUNNING, ts=time.time()))


async def test_publishes_on_a_real_server_get_their_sequences(nc: NATS) -> None:
    assert isinstance(nc, nats_io.Client)
    subject = subjects.attempt_reports("w1")
    seqs = [seq for i in range(50) for seq in await nats_io.publish_to_stream(
        nc, [(subject, report(i), {"Nats-Msg-Id": f"m{i}"})], subjects.EVENTS_STREAM)]
    assert seqs == sorted(seqs) and len(set(seqs)) == 50
    # The same message id again: JetStream's dedup answers with the first copy's sequence.
    again = await nats_io.publish_to_stream(nc, [(subject, report(0), {"Nats-Msg-Id": "m0"})],
                                            subjects.EVENTS_STREAM)
    assert again == [seqs[0]]
    info = await nc.jetstream().stream_info(subjects.EVENTS_STREAM)
    assert info.state.messages == 50


async def test_many_first_publishes_at_once_make_one_reply_subscription(
        nc: NATS, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(nc, nats_io.Client)
    subscriptions = len(nc._subs)
    # nats-py's subscribe suspends when its flush queue is full: as if it were, each time.
    send_subscribe = nc._send_subscribe

    async def suspending(sub: Any) -> None:
        await asyncio.sleep(0.01)
        await send_subscribe(sub)

    monkeypatch.setattr(nc, "_send_subscribe", suspending)
    subject = subjects.attempt_reports("w1")
    batches = await asyncio.gather(*(nc.publish_stored_batch(
        [(subject, report(i), {"Nats-Msg-Id": f"first{i}"})], subjects.EVENTS_STREAM)
        for i in range(20)))
    seqs = [seq for batch in batches for seq in await batch.wait(2)]
    assert all(isinstance(seq, int) for seq in seqs)  # every reply read, none timed out
    assert len(set(seqs)) == 20
    assert len(nc._subs) == subscriptions + 1


async def test_a_refused_publish_settles_at_once(nc: NATS) -> None:
    assert isinstance(nc, nats_io.Client)
    # A subject of another stream, published as the events stream's: JetStream refuses it.
    started = time.monotonic()
    with pytest.raises(nats.js.errors.BadRequestError):
        await nats_io.publish_to_stream(
            nc, [(subjects.SUBMIT_JOB, b"{}", {"Nats-Msg-Id": "w"})], subjects.EVENTS_STREAM)
    # No stream at all for the subject: the server says no one is there.
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await nats_io.publish_to_stream(
            nc, [("berth-test.nowhere", b"{}", {"Nats-Msg-Id": "n"})], subjects.EVENTS_STREAM)
    assert time.monotonic() - started < 2  # answered, not timed out


async def test_publish_events_retries_a_refusal_without_waiting_out_a_timeout(
        nc: NATS) -> None:
    outgoing = [nats_io.Outgoing(subjects.SUBMIT_JOB, b"{}", {"Nats-Msg-Id": "refused"})]
    started = time.monotonic()
    with pytest.raises(nats.js.errors.BadRequestError):
        await nats_io.publish_events(nc.jetstream(), outgoing, attempts=3, timeout=5)
    # Three tries and their backoff (0.1 s, 0.2 s): before, each try waited 5 s.
    assert time.monotonic() - started < 3
