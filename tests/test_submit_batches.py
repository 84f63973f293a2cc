"""Submits many at a time: a client's sweep (`berth.client.publish_submits`, its acks awaited
together) and the submitter deciding a fetched batch (`handle_batch`), where a job submit
that needs nothing read is decided without a task and the rest keep theirs, in order."""

from __future__ import annotations

import json
import time
from typing import Any

import nats.js.errors
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from berth.client import publish_submit, publish_submits
from berth.services.submitter.index import JobIndex
from berth.services.submitter.service import handle_batch, intake_job
from berth.shared import nats_io, pull_fetch, servers, subjects
from berth.shared.messages import (
    AnyEvent,
    JobSubmitted,
    ScheduleCreated,
    SubmitRejected,
    decode,
    event_decoder,
)

MAX_BYTES = 256 * 1024


def job(name: str, **fields: Any) -> bytes:
    return json.dumps({"name": name, "command": ["true"], **fields}).encode()


def submit(subject: str, data: bytes) -> Msg:
    """A submit as the submitter's consumer hands it over: its reply subject carries the
    stream sequence (7) and the time it was stored."""
    return Msg(None, subject=subject, reply="$JS.ACK.submit.submitter.1.7.7.1700000000000000000.0",
               data=data)


@pytest.mark.parametrize(("subject", "data", "kind", "final"), [
    (subjects.SUBMIT_JOB, job("plain"), JobSubmitted, True),
    (subjects.submit_job("ann"), job("plain"), JobSubmitted, True),
    (subjects.submit_job("ann"), b"{not json", SubmitRejected, True),
    (subjects.submit_job("ann"), job("a b"), SubmitRejected, True),
    # Each of these reads the stream (or, for a schedule, becomes another outcome).
    (subjects.submit_job("ann"), job("child", parent="j1-0000"), JobSubmitted, False),
    (subjects.submit_job("ann"), job("dep", after=["j1-0000"]), JobSubmitted, False),
    (subjects.submit_job("ann"), job("dep", after_any=["j1-0000"]), JobSubmitted, False),
    (subjects.submit_job("ann"), job("tok", tokens={"licence": 1}), JobSubmitted, False),
    (subjects.submit_job("ann"), job("cron", schedule={"cron": "* * * * *"}),
     JobSubmitted, False),
    (subjects.submit_job("ann"), job("once", existing="keep"), JobSubmitted, False),
    (subjects.submit_job("ann"), job("same", dedup="spec"), JobSubmitted, False),
    (subjects.submit_cancel("ann"), b'{"job_id": "j1-0000"}', type(None), False),
    ("berth.elsewhere", job("plain"), type(None), False),
])
def test_which_submits_are_decided_without_a_read(subject: str, data: bytes, kind: type,
                                                  final: bool) -> None:
    outcome, decided = intake_job(submit(subject, data), MAX_BYTES)
    assert isinstance(outcome, kind) and decided is final


def _outcome(event: AnyEvent | None) -> tuple[str, int]:
    assert isinstance(event, JobSubmitted | SubmitRejected | ScheduleCreated), event
    return type(event).__name__, event.submit_seq


async def _outcomes(nc: NATS) -> list[tuple[str, int, AnyEvent]]:
    """The submit outcomes in the events stream, in stream order."""
    js = nc.jetstream()
    info = await js.stream_info(subjects.EVENTS_STREAM)
    found = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(subjects.EVENTS_STREAM, seq)
        event = decode(event_decoder, msg.data or b"")
        if isinstance(event, JobSubmitted | SubmitRejected | ScheduleCreated):
            found.append((*_outcome(event), event))
    return found


async def test_a_batch_is_decided_in_submit_order_with_and_without_reads(nc: NATS) -> None:
    js = nc.jetstream()
    sub = await js.pull_subscribe(
        subjects.SUBMIT_ALL, durable=subjects.SUBMITTER_DURABLE, stream=subjects.SUBMIT_STREAM,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30.0,
                              deliver_policy=DeliverPolicy.ALL))
    outcomes = nats_io.EventPublisher(js)
    index = JobIndex(js)
    try:
        first = await publish_submit(nc, job("first"), subject=subjects.submit_job("ann"))
        await handle_batch(js, outcomes, await pull_fetch.fetch(sub, 10, 5), MAX_BYTES, index)
        [(_, _, made)] = await _outcomes(nc)
        assert isinstance(made, JobSubmitted) and made.submit_seq == first
        # Plain jobs around ones that read the stream: a dependency that exists, one that
        # does not, and a schedule; a plain one before the first read and after it.
        payloads = [job("a"), job("b"), job("after-first", after=[made.job_id]), job("c"),
                    job("after-nothing", after=["j1-0000"]), b"{not json",
                    job("cron", schedule={"cron": "0 * * * *"}), job("d")]
        seqs = await publish_submits(nc, payloads, subject=subjects.submit_job("ann"))
        assert seqs == list(range(first + 1, first + 1 + len(payloads)))
        batch = await pull_fetch.fetch(sub, 50, 5)
        assert len(batch) == len(payloads)  # one batch: the case under test
        await handle_batch(js, outcomes, batch, MAX_BYTES, index)
        stored = [(kind, seq) for kind, seq, _ in (await _outcomes(nc))[1:]]
        assert sorted(stored, key=lambda outcome: outcome[1]) == [
            ("JobSubmitted", seqs[0]), ("JobSubmitted", seqs[1]), ("JobSubmitted", seqs[2]),
            ("JobSubmitted", seqs[3]), ("SubmitRejected", seqs[4]),
            ("SubmitRejected", seqs[5]), ("ScheduleCreated", seqs[6]),
            ("JobSubmitted", seqs[7])]
        # Those before the first that reads are stored in submit order (as when each had a
        # task: one that reads lets later ones that do not pass it).
        assert stored[:2] == [("JobSubmitted", seqs[0]), ("JobSubmitted", seqs[1])]
        # Every submit acknowledged: none is redelivered.
        consumer = await js.consumer_info(subjects.SUBMIT_STREAM, subjects.SUBMITTER_DURABLE)
        assert consumer.num_ack_pending == 0 and consumer.num_pending == 0
    finally:
        await index.close()
        await sub.unsubscribe()


async def test_a_sweep_of_submits_gets_each_its_sequence(nc: NATS) -> None:
    payloads = [job(f"sweep{i}") for i in range(300)]
    seqs = await publish_submits(nc, payloads)
    assert seqs == sorted(seqs) and len(set(seqs)) == 300
    js = nc.jetstream()
    for seq, payload in zip(seqs[::50], payloads[::50], strict=True):
        assert (await js.get_msg(subjects.SUBMIT_STREAM, seq)).data == payload
    assert await publish_submits(nc, []) == []
    # The same sweep again with its dedup ids: JetStream answers with the first copies.
    ids = [f"sweep-{i}" for i in range(3)]
    first = await publish_submits(nc, payloads[:3], msg_ids=ids)
    assert await publish_submits(nc, payloads[:3], msg_ids=ids) == first
    with pytest.raises(ValueError, match="msg_ids: 2 ids for 3 submits"):
        await publish_submits(nc, payloads[:3], msg_ids=ids[:2])


async def test_a_sweep_on_nats_pys_own_client_gets_the_same(
        clean_servers: tuple[servers.ServerProcess, servers.RedisServer]) -> None:
    server = clean_servers[0]
    plain = NATS()
    await plain.connect(server.url, **nats_io.auth_options(server.admin_creds()))
    try:
        seqs = await publish_submits(plain, [job(f"p{i}") for i in range(20)])
        assert seqs == sorted(seqs) and len(set(seqs)) == 20
    finally:
        await plain.close()


async def test_a_sweep_raises_what_a_refused_submit_raises(nc: NATS) -> None:
    # A subject no stream takes: each way of submitting says so, and neither waits it out.
    started = time.monotonic()
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await publish_submit(nc, job("x"), subject="berth-test.nowhere")
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await publish_submits(nc, [job("x"), job("y")], subject="berth-test.nowhere")
    assert time.monotonic() - started < 2
