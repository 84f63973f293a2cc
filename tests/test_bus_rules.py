"""The pure rules behind the bus's security: which subjects each role's permissions open
(read as nats-server reads them), and which events the fold believes from which subject."""

from __future__ import annotations

import pytest

from berth.shared import subjects
from berth.shared.bus_permissions import authorization_config, permissions
from berth.shared.credentials import CredentialsError, Role, generate
from berth.shared.event_origin import RefusedEvent, read_event, refusal
from berth.shared.messages import (
    AttemptReported,
    JobSpec,
    JobSubmitted,
    LeaderElected,
    NodeAction,
    NodeHealthChanged,
    PendingReasonsChanged,
    TaskAssigned,
    TasksAssigned,
    WorkerDeclaredDead,
    WorkerRegistered,
    encode,
)
from berth.shared.states import TaskState


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, `>` one or more trailing tokens."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


def may_publish(role: Role, scope: str, subject: str) -> bool:
    perms = permissions(role, scope, subjects.inbox_prefix("me"))
    return any(matches(p, subject) for p in perms.publish)


def may_subscribe(role: Role, scope: str, subject: str) -> bool:
    perms = permissions(role, scope, subjects.inbox_prefix("me"))
    return any(matches(p, subject) for p in perms.subscribe)


W, U = "w1", "ada"
PUBLISH = [
    # (role, scope, subject, allowed)
    (Role.WORKER, W, subjects.attempt_reports(W), True),
    (Role.WORKER, W, subjects.worker_events(W), True),
    (Role.WORKER, W, subjects.heartbeat(W), True),
    (Role.WORKER, W, subjects.attempt_logs(W, "j1-aaaa", 0, 0), True),
    (Role.WORKER, W, subjects.attempt_reports("w2"), False),
    (Role.WORKER, W, subjects.worker_events("w2"), False),
    (Role.WORKER, W, subjects.heartbeat("w2"), False),
    (Role.WORKER, W, subjects.attempt_logs("w2", "j1-aaaa", 0, 0), False),
    (Role.WORKER, W, subjects.worker_commands("w2"), False),
    (Role.WORKER, W, subjects.worker_commands(W), False),
    (Role.WORKER, W, subjects.task_events("j1-aaaa"), False),
    (Role.WORKER, W, subjects.worker_verdicts(W), False),
    (Role.WORKER, W, subjects.LEADER, False),
    (Role.WORKER, W, subjects.LEADER_EVENTS, False),
    (Role.WORKER, W, subjects.submit_job(W), False),
    (Role.WORKER, W, "$JS.API.STREAM.DELETE.BERTH_EVENTS", False),
    # Bundles: workers read them and write nothing; submit users upload (chunks and
    # metadata) and can neither read the bucket back nor purge or delete it.
    (Role.WORKER, W, "$JS.API.STREAM.INFO.OBJ_BERTH_BUNDLES", True),
    (Role.WORKER, W, "$JS.API.STREAM.MSG.GET.OBJ_BERTH_BUNDLES", True),
    (Role.WORKER, W, "$JS.API.CONSUMER.CREATE.OBJ_BERTH_BUNDLES", True),
    (Role.WORKER, W, "$O.BERTH_BUNDLES.C.abc", False),
    (Role.WORKER, W, "$O.BERTH_BUNDLES.M.abc", False),
    (Role.WORKER, W, "$JS.API.STREAM.PURGE.OBJ_BERTH_BUNDLES", False),
    (Role.SUBMIT, U, "$JS.API.STREAM.INFO.OBJ_BERTH_BUNDLES", True),
    (Role.SUBMIT, U, "$JS.API.STREAM.MSG.GET.OBJ_BERTH_BUNDLES", True),
    (Role.SUBMIT, U, "$O.BERTH_BUNDLES.C.abc", True),
    (Role.SUBMIT, U, "$O.BERTH_BUNDLES.M.c2hhMjU2OmFi", True),
    (Role.SUBMIT, U, "$JS.API.CONSUMER.CREATE.OBJ_BERTH_BUNDLES", False),
    (Role.SUBMIT, U, "$JS.API.STREAM.PURGE.OBJ_BERTH_BUNDLES", False),
    (Role.SUBMIT, U, "$JS.API.STREAM.DELETE.OBJ_BERTH_BUNDLES", False),
    (Role.SUBMIT, U, "$JS.API.STREAM.CREATE.OBJ_BERTH_BUNDLES", False),
    (Role.SCHEDULER, "", "$O.BERTH_BUNDLES.C.abc", False),
    (Role.SCHEDULER, "", "$JS.API.STREAM.CREATE.OBJ_BERTH_BUNDLES", True),
    (Role.SUBMIT, U, subjects.submit_job(U), True),
    (Role.SUBMIT, U, subjects.submit_cancel(U), True),
    (Role.SUBMIT, U, f"$JS.API.DIRECT.GET.BERTH_EVENTS.{subjects.submit_outcome(U, 7)}", True),
    (Role.SUBMIT, U, f"$JS.API.DIRECT.GET.BERTH_EVENTS.{subjects.submit_outcome('bob', 7)}",
     False),
    (Role.SUBMIT, U, "$JS.API.DIRECT.GET.BERTH_EVENTS", False),
    (Role.SUBMIT, U, "$JS.API.CONSUMER.CREATE.BERTH_EVENTS", False),
    (Role.SUBMIT, U, subjects.submit_job("bob"), False),
    (Role.SUBMIT, U, subjects.SUBMIT_JOB, False),
    (Role.SUBMIT, U, subjects.worker_commands(W), False),
    (Role.SUBMIT, U, subjects.attempt_reports(W), False),
    # Cluster limits (quotas, tokens): only an admin writes them; the submitter may look a
    # token up, nothing else.
    (Role.ADMIN, "", subjects.ADMIN_QUOTAS, True),
    (Role.SCHEDULER, "", subjects.ADMIN_QUOTAS, False),
    (Role.SCHEDULER, "", subjects.admin_tokens("io"), False),
    (Role.SUBMITTER, "", subjects.admin_tokens("io"), False),
    (Role.SUBMITTER, "", f"$JS.API.DIRECT.GET.BERTH_EVENTS.{subjects.admin_tokens('io')}", True),
    (Role.SUBMITTER, "", f"$JS.API.DIRECT.GET.BERTH_EVENTS.{subjects.ADMIN_QUOTAS}", False),
    (Role.DASHBOARD, "", subjects.ADMIN_QUOTAS, False),
    (Role.SUBMIT, U, subjects.admin_tokens("io"), False),
    (Role.WORKER, W, subjects.ADMIN_QUOTAS, False),
    (Role.SCHEDULER, "", subjects.worker_commands(W), True),
    (Role.SCHEDULER, "", subjects.task_events("j1-aaaa"), True),
    (Role.SCHEDULER, "", subjects.ASSIGNMENTS, True),
    (Role.WORKER, W, subjects.ASSIGNMENTS, False),
    (Role.SUBMITTER, "", subjects.ASSIGNMENTS, False),
    (Role.DASHBOARD, "", subjects.ASSIGNMENTS, False),
    (Role.SCHEDULER, "", subjects.worker_verdicts(W), True),
    (Role.SCHEDULER, "", subjects.LEADER, True),
    (Role.SCHEDULER, "", subjects.attempt_reports(W), False),
    (Role.SCHEDULER, "", subjects.submit_outcome(U, 1), False),
    (Role.SCHEDULER, "", "$JS.API.STREAM.DELETE.BERTH_EVENTS", False),
    # Compaction (docs/retention.md): the leader purges finished jobs' subjects, never
    # deletes the stream; no other service role may purge it.
    (Role.SCHEDULER, "", "$JS.API.STREAM.PURGE.BERTH_EVENTS", True),
    (Role.SCHEDULER, "", subjects.JOBS_COMPACTED, True),
    (Role.WORKER, W, subjects.JOBS_COMPACTED, False),
    (Role.SUBMITTER, "", subjects.JOBS_COMPACTED, False),
    (Role.SUBMITTER, "", "$JS.API.STREAM.PURGE.BERTH_EVENTS", False),
    (Role.DASHBOARD, "", "$JS.API.STREAM.PURGE.BERTH_EVENTS", False),
    (Role.SUBMIT, U, subjects.ADMIN_COMPACT, False),
    (Role.SUBMITTER, "", subjects.submit_outcome(U, 1), True),
    (Role.SUBMITTER, "", subjects.task_events("j1-aaaa"), False),
    (Role.SUBMITTER, "", subjects.worker_commands(W), False),
    (Role.SUBMITTER, "", subjects.LEADER_EVENTS, False),
    (Role.DASHBOARD, "", subjects.submit_job(U), True),
    (Role.DASHBOARD, "", subjects.SUBMIT_CANCEL, True),
    (Role.DASHBOARD, "", subjects.task_events("j1-aaaa"), False),
    (Role.DASHBOARD, "", subjects.worker_commands(W), False),
    (Role.DASHBOARD, "", subjects.submit_outcome(U, 1), False),
    (Role.ADMIN, "", "$JS.API.STREAM.DELETE.BERTH_EVENTS", True),
]


@pytest.mark.parametrize(("role", "scope", "subject", "allowed"), PUBLISH)
def test_who_may_publish_where(role: Role, scope: str, subject: str, allowed: bool) -> None:
    assert may_publish(role, scope, subject) is allowed


@pytest.mark.parametrize(("role", "scope", "subject", "allowed"), [
    (Role.WORKER, W, subjects.worker_commands(W), True),
    (Role.WORKER, W, subjects.LEADER, True),
    (Role.WORKER, W, subjects.worker_commands("w2"), False),
    (Role.WORKER, W, subjects.HEARTBEATS_ALL, False),
    (Role.WORKER, W, "_INBOX.other.abc.1", False),
    (Role.WORKER, W, "_INBOX.me.abc.1", True),
    (Role.SUBMIT, U, subjects.EVENTS_ALL, False),
    (Role.SUBMIT, U, "_INBOX.me.x.y", True),
    (Role.SCHEDULER, "", subjects.heartbeat(W), True),
    (Role.SCHEDULER, "", subjects.worker_commands(W), False),
])
def test_who_may_subscribe_where(role: Role, scope: str, subject: str, allowed: bool) -> None:
    assert may_subscribe(role, scope, subject) is allowed


@pytest.mark.parametrize("bad", ["w1.>", "*", ">", "a.b", "x" * 65, "a b"])
def test_a_scope_cannot_widen_a_permission(bad: str) -> None:
    with pytest.raises(CredentialsError, match="must be 1-64"):
        generate(Role.WORKER, bad)


def test_the_server_config_names_each_identity_by_public_key_only() -> None:
    creds = [generate(Role.WORKER, "w1"), generate(Role.SUBMIT, "ada"), generate(Role.ADMIN)]
    users = authorization_config([c.identity for c in creds])["users"]
    assert [u["nkey"] for u in users] == [c.public_key for c in creds]
    assert all(c.seed not in str(users) for c in creds)


SPEC = JobSpec(name="x", command=["true"])
ORIGIN = [
    (subjects.submit_outcome(U, 3), JobSubmitted(job_id="j3-aaaa", submit_seq=3, spec=SPEC),
     True),
    (subjects.attempt_reports(W), JobSubmitted(job_id="j3-aaaa", submit_seq=3, spec=SPEC),
     False),
    (subjects.task_events("j3-aaaa"), TaskAssigned(
        job_id="j3-aaaa", task_index=0, attempt_id=0, worker_id=W, incarnation="i", epoch=1),
     True),
    # A worker's own subject carries anything it likes; the fold believes only its reports.
    (subjects.attempt_reports(W), TaskAssigned(
        job_id="j3-aaaa", task_index=0, attempt_id=0, worker_id=W, incarnation="i", epoch=1),
     False),
    (subjects.task_events("j9-bbbb"), TaskAssigned(
        job_id="j3-aaaa", task_index=0, attempt_id=0, worker_id=W, incarnation="i", epoch=1),
     False),
    # A tick's batch: only from the scheduler's subject, every entry of the batch's term.
    (subjects.ASSIGNMENTS, TasksAssigned(epoch=1, assignments=[TaskAssigned(
        job_id="j3-aaaa", task_index=0, attempt_id=0, worker_id=W, incarnation="i", epoch=1)]),
     True),
    (subjects.task_events("j3-aaaa"), TasksAssigned(epoch=1, assignments=[TaskAssigned(
        job_id="j3-aaaa", task_index=0, attempt_id=0, worker_id=W, incarnation="i", epoch=1)]),
     False),
    (subjects.ASSIGNMENTS, TasksAssigned(epoch=2, assignments=[TaskAssigned(
        job_id="j3-aaaa", task_index=0, attempt_id=0, worker_id=W, incarnation="i", epoch=1)]),
     False),
    (subjects.attempt_reports(W), AttemptReported(
        job_id="j3-aaaa", task_index=0, attempt_id=0, worker_id=W, state=TaskState.RUNNING),
     True),
    (subjects.attempt_reports(W), AttemptReported(
        job_id="j3-aaaa", task_index=0, attempt_id=0, worker_id="w2", state=TaskState.RUNNING),
     False),
    (subjects.worker_events(W), WorkerDeclaredDead(worker_id=W, incarnation="i"), False),
    (subjects.worker_verdicts(W), WorkerDeclaredDead(worker_id=W, incarnation="i"), True),
    # A worker may not lift its own quarantine: node health comes only on its verdicts.
    (subjects.worker_events(W), NodeHealthChanged(worker_id=W, action=NodeAction.UNCORDON),
     False),
    (subjects.worker_verdicts(W), NodeHealthChanged(worker_id=W, action=NodeAction.UNCORDON),
     True),
    (subjects.worker_verdicts(W), NodeHealthChanged(worker_id="w2", action=NodeAction.CORDON),
     False),
    (subjects.worker_events(W), WorkerRegistered(worker_id="w2", incarnation="i",
                                                 resources=SPEC.resources), False),
    (subjects.worker_events(W), LeaderElected(scheduler_id="s", epoch=10**9), False),
    (subjects.LEADER_EVENTS, LeaderElected(scheduler_id="s", epoch=2), True),
    (subjects.attempt_reports(W), PendingReasonsChanged(reasons=[], epoch=1), False),
]


@pytest.mark.parametrize(("subject", "event", "believed"), ORIGIN)
def test_which_events_the_fold_believes_from_where(subject: str, event: object,
                                                   believed: bool) -> None:
    assert (refusal(subject, event) is None) is believed  # type: ignore[arg-type]
    if believed:
        assert read_event(subject, encode(event)) == event  # type: ignore[arg-type]
    else:
        with pytest.raises(RefusedEvent, match="may not come from"):
            read_event(subject, encode(event))  # type: ignore[arg-type]


@pytest.mark.parametrize("data", [
    b"{" * 20_000, b'{"x":' + b"[" * 1000 + b"]" * 1000 + b"}", b"\xff\xfe", b"",
    b'{"type":"attempt_reported","job_id":' + b'"' + b"a" * (1 << 20) + b'"}',
    b'{"type":"leader_elected","scheduler_id":"s","epoch":1' + b"0" * 40 + b"}",
])
def test_no_bytes_make_reading_an_event_raise_anything_but_a_refusal(data: bytes) -> None:
    with pytest.raises(RefusedEvent):
        read_event(subjects.attempt_reports(W), data)


def test_a_heartbeat_is_believed_only_from_its_own_workers_subject() -> None:
    from berth.shared.event_origin import read_heartbeat
    from berth.shared.messages import Heartbeat

    hb = encode(Heartbeat(worker_id="w2", incarnation="i", ts=1.0))
    assert read_heartbeat(subjects.heartbeat("w2"), hb).worker_id == "w2"
    with pytest.raises(RefusedEvent, match="naming worker w2"):
        read_heartbeat(subjects.heartbeat("w1"), hb)
    with pytest.raises(RefusedEvent, match="undecodable"):
        read_heartbeat(subjects.heartbeat("w1"), b"[" * 5000)


@pytest.mark.parametrize(("victim", "believed"), [
    ("j3-aaaa/0/1", True), ("j3-aaaa/x/1", False), ("garbage", False), ("j3-aaaa/0/1/2", False),
    ("j3-aaaa/0/" + "9" * 5000, False),
])
def test_a_preemption_naming_a_victim_no_fold_could_parse_is_refused(victim: str,
                                                                     believed: bool) -> None:
    # Every fold parses a preemption's victims: one it could not parse would stop them all.
    from berth.shared.lifecycle import ClusterState
    from berth.shared.messages import TasksPreempted

    event = encode(TasksPreempted(id="p1", job_id="j3-aaaa", victims=[victim], hosts=[W],
                                  epoch=1))
    subject = subjects.task_events("j3-aaaa")
    if believed:
        ClusterState().apply(1, read_event(subject, event))
    else:
        with pytest.raises(RefusedEvent, match="undecodable"):
            read_event(subject, event)
