"""Generated garbage for every decoder and subject berth listens on: random bytes, truncated
and mutated valid messages, huge numbers, wrong types, deep nesting (1,000 and 20,000
levels), 200 KiB strings; on the submit, event, heartbeat, command and leader subjects. And
the forged epochs: a `berth.leader` announcement and a `leader_elected` event with huge
epochs, published as the admin identity (the only one besides the scheduler that may).

The generator is pure (a seeded random.Random in, (subject, payload) pairs out); `send`
publishes them as the admin connection it is given. Valid-looking messages name a worker
incarnation ("fuzz") and jobs no one runs, so none can stand for a real worker's or job's
message: an admin may write anything, and this fuzzes the decoders, not the admin's rights.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from nats.aio.client import Client as NATS

from berth.shared import subjects
from berth.shared.messages import (
    AttemptReported,
    CancelRequest,
    Constraint,
    Heartbeat,
    JobSpec,
    JobSubmitted,
    KillAttempt,
    LeaderAnnouncement,
    LeaderElected,
    Op,
    PendingReason,
    PendingReasonsChanged,
    Resources,
    RunAttempt,
    TaskAssigned,
    WorkerDeclaredDead,
    WorkerRegistered,
    encode,
)
from berth.shared.states import TaskState

HUGE = [b"1" + b"0" * 30, b"-1" + b"0" * 30, b"1e308", b"1e999", b"-1e999",
        b"18446744073709551616", b"-9223372036854775809", b"0.0000000000000000000001"]
WRONG = [b"null", b"[]", b"{}", b"true", b'"x"', b"-1", b"[[[]]]"]
NUMBER = re.compile(rb"-?\d+(\.\d+)?")
VALUE = re.compile(rb'(?<=:)("[^"]*"|-?\d+(\.\d+)?|true|false|null)')
STRING = re.compile(rb'(?<=:)"[^"]*"')
BIG_STRING = 200 * 1024
FAKE_WORKER = "fuzz-w"
FAKE_JOB = "j1-fuzz0000"
# What the checker rightly finds in the forged events alone: two forged assignments of the
# fake job's key to the fake worker (a mutated timestamp makes them two), or one after a
# forged late assignment burned its id. True of the log, but the admin's writing (an admin
# may write anything), not berth's: a key of a real job, or a real worker, never matches.
FORGED_REUSE = re.compile(
    rf"attempt_keys_reused: {FAKE_JOB}/0/-?\d+: to {FAKE_WORKER}"
    rf"( and to {FAKE_WORKER}| after a void assignment burned the id)")


def deep(levels: int) -> bytes:
    return b'{"x":' + b"[" * levels + b"]" * levels + b"}"


def deep_objects(levels: int) -> bytes:
    return b'{"a":' * levels + b"1" + b"}" * levels


def samples(worker: str) -> dict[str, list[bytes]]:
    """Valid messages per kind of subject, to truncate and mutate."""
    # A forged JobSubmitted that stays valid must name a job no one runs: were it placed on
    # a real worker, a forged TaskAssigned for the same key would be a real key reuse (seed
    # 15 made one: attempt 0 to fuzz-w and to local-0). No worker has this attribute.
    spec = JobSpec(name="fuzz", command=["true"], resources=Resources(cpu=0.1, memory_mb=8),
                   constraints=[Constraint(key="fuzz-never", op=Op.EQ, value="x")])
    return {
        "submit": [encode(spec)],
        "cancel": [encode(CancelRequest(job_id=FAKE_JOB, reason="fuzz"))],
        "event": [
            encode(JobSubmitted(job_id=FAKE_JOB, submit_seq=1, spec=spec)),
            encode(AttemptReported(job_id=FAKE_JOB, task_index=0, attempt_id=0,
                                   worker_id=FAKE_WORKER, state=TaskState.SUCCEEDED)),
            encode(TaskAssigned(job_id=FAKE_JOB, task_index=0, attempt_id=0,
                                worker_id=FAKE_WORKER, incarnation="fuzz", epoch=1)),
            encode(WorkerRegistered(worker_id=FAKE_WORKER, incarnation="fuzz",
                                    resources=Resources(cpu=1, memory_mb=64))),
            encode(WorkerDeclaredDead(worker_id=FAKE_WORKER, incarnation="fuzz", epoch=1)),
            encode(PendingReasonsChanged(reasons=[PendingReason(FAKE_JOB, 0, "x")],
                                         epoch=1)),
        ],
        "heartbeat": [encode(Heartbeat(worker_id=worker, incarnation="fuzz", ts=1.0,
                                       attempts=[f"{FAKE_JOB}/0/0"]))],
        "command": [
            encode(RunAttempt(epoch=1, incarnation="fuzz", job_id=FAKE_JOB,
                              task_index=0, attempt_id=0, command=["true"], env={},
                              resources=Resources(cpu=0.1, memory_mb=8))),
            encode(KillAttempt(epoch=1, incarnation="fuzz", job_id=FAKE_JOB,
                               task_index=0, attempt_id=0)),
        ],
        "leader": [encode(LeaderAnnouncement(epoch=1, scheduler_id="fuzz"))],
    }


def targets(workers: list[str]) -> list[tuple[str, str]]:
    """(kind, subject) for every subject berth decodes: the submit stream, each kind of
    events-stream subject, heartbeats, worker commands and the leader announcement."""
    out = [("submit", subjects.submit_job()), ("submit", subjects.submit_job("fuzz")),
           ("cancel", subjects.submit_cancel()),
           ("event", subjects.attempt_reports(FAKE_WORKER)),
           ("event", subjects.worker_events(FAKE_WORKER)),
           ("event", subjects.task_events(FAKE_JOB)),
           ("event", subjects.submit_outcome("fuzz", 999_999)),
           ("event", subjects.PENDING_REASONS), ("event", subjects.worker_verdicts(FAKE_WORKER)),
           ("leader", subjects.LEADER)]
    for worker in workers:
        out += [("heartbeat", subjects.heartbeat(worker)),
                ("command", subjects.worker_commands(worker))]
    return out


def forged_only(violation: str) -> bool:
    """Whether a checker finding is about the forged job and worker alone (FORGED_REUSE)."""
    return FORGED_REUSE.fullmatch(violation) is not None


def mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        where = rng.randrange(len(out) + 1)
        match rng.randrange(3):
            case 0 if out:
                out[min(where, len(out) - 1)] = rng.randrange(256)
            case 1:
                out[where:where] = bytes([rng.randrange(256)])
            case _:
                del out[where:where + rng.randint(1, 8)]
    return bytes(out)


def _replace_one(rng: random.Random, pattern: re.Pattern[bytes], data: bytes, new: bytes
                 ) -> bytes:
    found = list(pattern.finditer(data))
    if not found:
        return data + new
    m = rng.choice(found)
    return data[:m.start()] + new + data[m.end():]


def big_payload(rng: random.Random, valid: bytes, which: int, readable: bool = True) -> bytes:
    """The `which`-th big payload, in turn: 20,000 levels of lists, of objects, or (only where
    the payload may stay readable) a 200 KiB string. Taken in turn rather than drawn, so a
    short run covers each whatever the subjects' count does to the random draws."""
    kinds = 3 if readable else 2
    match which % kinds:
        case 0:
            return deep(20_000)
        case 1:
            return deep_objects(20_000)
        case _:
            return _replace_one(rng, STRING, valid, b'"' + b"a" * BIG_STRING + b'"')


def garbage(rng: random.Random, valid: bytes, readable: bool = True) -> bytes:
    """One generated small payload from a valid message of the subject's kind.
    `readable=False`: only payloads that cannot decode (no mutation that may leave the
    message well-formed)."""
    choice = rng.randrange(8)
    if not readable and choice in (2, 3, 4, 7):
        choice = rng.choice([0, 1, 5, 6])
    match choice:
        case 0:
            return rng.randbytes(rng.choice([0, 1, 8, 64, 512, 2048]))
        case 1:
            return valid[:rng.randrange(len(valid))]
        case 2 | 3:
            return mutate(rng, valid)
        case 4:
            return _replace_one(rng, NUMBER, valid, rng.choice(HUGE))
        case 5:
            return _replace_one(rng, VALUE, valid, rng.choice(WRONG))
        case 6:
            return rng.choice([deep(1000), deep_objects(1000), b"[" * 1000, b"{" * 1000])
        case _:
            return _replace_one(rng, STRING, valid, b'"' + b"\\u0000\xff" * 20 + b'"')


def payloads(rng: random.Random, count: int, workers: list[str], big_every: int = 500
             ) -> Iterator[tuple[str, bytes]]:
    """`count` (subject, payload) pairs over every target, round robin; every `big_every`-th
    payload is a big one (big_payload)."""
    per_worker = {w: samples(w) for w in workers} or {"": samples(FAKE_WORKER)}
    common = next(iter(per_worker.values()))
    subject_list = targets(workers)
    for i in range(count):
        kind, subject = subject_list[i % len(subject_list)]
        worker = subject.split(".")[2] if kind == "heartbeat" else ""
        valid = per_worker.get(worker, common)
        # A well-formed announcement of another epoch is the epoch fence's case, not the
        # decoder's: forged_epochs() sends those on purpose.
        sample, readable = rng.choice(valid[kind]), kind != "leader"
        if i % big_every == big_every // 2:
            yield subject, big_payload(rng, sample, i // big_every, readable)
        else:
            yield subject, garbage(rng, sample, readable)


def forged_epochs() -> list[tuple[str, bytes]]:
    """Leader announcements and elections of epochs no lease gave (issue 21 item 2): a
    little ahead of the real one, and absurd."""
    return [(subjects.LEADER, encode(LeaderAnnouncement(epoch=7, scheduler_id="forger"))),
            (subjects.LEADER, encode(LeaderAnnouncement(epoch=10**9, scheduler_id="forger"))),
            (subjects.LEADER, encode(LeaderAnnouncement(epoch=10**30, scheduler_id="forger"))),
            (subjects.LEADER_EVENTS, encode(LeaderElected(scheduler_id="forger",
                                                          epoch=10**9))),
            (subjects.LEADER_EVENTS, encode(LeaderElected(scheduler_id="forger",
                                                          epoch=10**30)))]


async def send(nc: NATS, count: int, workers: list[str], seed: int = 15,
               epochs: bool = True) -> int:
    """Publishes `count` generated payloads (and the forged epochs, unless told not to)
    as `nc`'s identity; returns how many were sent. Flushes every few hundred so no
    service's subscription is buried faster than it reads."""
    rng = random.Random(seed)
    sent = 0
    for subject, payload in payloads(rng, count, workers):
        await nc.publish(subject, payload)
        sent += 1
        if sent % 200 == 0:
            await nc.flush(timeout=30)
    if epochs:
        for subject, payload in forged_epochs():
            await nc.publish(subject, payload)
            sent += 1
    await nc.flush(timeout=30)
    return sent
