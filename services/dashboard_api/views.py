"""The JSON shapes the HTTP API returns, built from the folded state. States are given by
their display names (`running`, `worker_failed`), as on the dashboard."""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

from berth.shared import schedules, task_rules
from berth.shared.capacity import Amounts
from berth.shared.lifecycle import AttemptView, JobView, ScheduleView, TaskView, WorkerView
from berth.shared.limits import Limits, Usage
from berth.shared.messages import (
    DeviceStats,
    GpuTelemetry,
    JobSpec,
    Quota,
    Reason,
    Resources,
    ResourceUse,
    User,
)
from berth.shared.states import JOB_TERMINAL, JobState, TaskState, job_state_names


class AttemptOut(msgspec.Struct):
    attempt_id: int
    worker_id: str
    state: str
    assigned_at: float
    started_at: float | None
    finished_at: float | None
    exit_code: int | None
    error: str
    worker_failure: bool
    exited: bool
    ports: dict[str, int]
    group: str
    coordinator: str
    devices: list[int] = []  # indices of its worker's devices (GPUs) it holds
    gpu: GpuTelemetry | None = None  # peak GPU memory and utilisation, once it has ended
    usage: ResourceUse | None = None  # CPU time and peak RSS of its processes, once ended


class TaskOut(msgspec.Struct):
    index: int
    state: str
    current_attempt: int | None
    failure_count: int
    preemption_count: int
    exit_code: int | None
    error: str
    pending_reason: str
    pending_since: float | None
    attempts: list[AttemptOut]
    refused_reports: list[str]
    # Retries under the job's retry policy, and (while it waits out a backoff) the time
    # before which it is not placed.
    retries: int
    retry_at: float | None


class JobSummary(msgspec.Struct):
    job_id: str
    name: str
    user: str
    state: str
    replicas: int
    parent: str | None
    task_counts: dict[str, int]
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    error: str
    # Why it ended other than by its own tasks: "DEPENDENCY" (an `after` job failed), or "".
    failure_reason: str
    # The job it waits for before its tasks may be placed (`after`/`after_any`), or "".
    waiting_for: str


class StateNames(msgspec.Struct):
    """The state names this API speaks: `job` are those `GET /api/jobs?state=` accepts."""
    job: list[str]
    job_terminal: list[str]
    task: list[str]


def state_names() -> StateNames:
    return StateNames(job=job_state_names(),
                      job_terminal=[s.display for s in JobState if s in JOB_TERMINAL],
                      task=[s.display for s in TaskState if s is not TaskState.UNSPECIFIED])


class JobPage(msgspec.Struct):
    jobs: list[JobSummary]
    # Pass as `cursor` for the next page (older jobs); null on the last page.
    next_cursor: str | None


class TaskDetail(TaskOut):
    job_id: str
    job_state: str


class QueuePlace(msgspec.Struct):
    """Where a job with pending tasks stands in its priority band's queue."""

    band: str
    position: int  # 1: placed next, once capacity allows
    of: int  # jobs in the band with pending tasks


class JobDetail(JobSummary):
    spec: JobSpec
    children: list[str]
    tasks: list[TaskOut]


class DeviceOut(msgspec.Struct):
    index: int
    uuid: str
    model: str
    memory_mb: int
    held_by: str | None  # the attempt key holding it, if any
    unhealthy: str | None = None  # why it takes no new attempts, if it does not
    # From the worker's latest heartbeat (NVML), where it discovered the device:
    utilization: int | None = None  # percent
    memory_used_mb: int | None = None
    temperature_c: int | None = None


class WorkerOut(msgspec.Struct):
    worker_id: str
    incarnation: str
    host: str
    healthy: bool
    resources: Resources
    cpu_free: float
    memory_free_mb: int
    disk_free_mb: int
    devices_free: int
    address: str
    held_by_gang: str | None
    attributes: dict[str, str]
    registered_at: float
    last_heartbeat: float | None
    running_attempts: list[str]
    devices: list[DeviceOut] = []
    # Why it takes no new work ("cordoned: ...", "draining: ...", "quarantined: ..."), or "".
    out_of_service: str = ""
    drain_deadline: float | None = None  # a drain's: when what still runs is preempted
    recent_failures: int = 0  # attempts that failed here for non-user causes, since release


class SubmitOutcome(msgspec.Struct):
    submit_seq: int
    accepted: bool
    job_id: str | None = None
    reason: str | None = None
    # When accepted: "job", "cancel", "schedule" (job_id is the schedule's id), or what an
    # `existing`/`dedup` policy did: "kept" or "deduplicated" (job_id is the existing job).
    kind: str | None = None
    note: str = ""  # e.g. "deduplicated to j12-ab34", "recreated: cancelled j9-cd56"


class CancelBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    reason: Reason = ""
    user: User = ""


class SubmitAccepted(msgspec.Struct):
    submit_seq: int
    # Set once the submitter has accepted it (within the request's wait).
    job_id: str | None = None
    outcome: str = ""  # where the outcome can be read


class CancelAccepted(msgspec.Struct):
    job_id: str
    submit_seq: int


def attempt_out(a: AttemptView) -> AttemptOut:
    return AttemptOut(
        attempt_id=a.attempt_id, worker_id=a.worker_id, state=a.state.display,
        assigned_at=a.assigned_at, started_at=a.started_at, finished_at=a.finished_at,
        exit_code=a.exit_code, error=a.error, worker_failure=a.worker_failure, exited=a.exited,
        ports=a.ports, group=a.group, coordinator=a.coordinator, devices=list(a.devices),
        gpu=a.gpu, usage=a.usage,
    )


def task_out(t: TaskView, now: float | None = None) -> TaskOut:
    current = t.current_attempt
    pending = t.state == TaskState.PENDING
    # A backoff's countdown is stated as of now, not as of the event that began it.
    backoff = task_rules.backoff_reason(t.retry_at, t.retries,
                                        time.time() if now is None else now)
    return TaskOut(
        index=t.index, state=t.state.display,
        current_attempt=current.attempt_id if current else None,
        failure_count=t.failure_count, preemption_count=t.preemption_count,
        exit_code=t.exit_code, error=t.error,
        pending_reason=(backoff if pending and backoff else t.pending_reason),
        pending_since=t.pending_since if pending else None,
        attempts=[attempt_out(a) for a in t.attempts], refused_reports=list(t.refused_reports),
        retries=t.retries, retry_at=t.retry_at if pending and backoff else None,
    )


def task_detail(job: JobView, task: TaskView) -> TaskDetail:
    return TaskDetail(**msgspec.structs.asdict(task_out(task)), job_id=job.job_id,
                      job_state=job.state.display)


def _summary_fields(job: JobView) -> dict[str, object]:
    return dict(
        job_id=job.job_id, name=job.spec.name, user=job.spec.user, state=job.state.display,
        replicas=job.spec.replicas, parent=job.spec.parent, task_counts=job.task_counts(),
        submitted_at=job.submitted_at, started_at=job.started_at,
        finished_at=job.finished_at, error=job.error, failure_reason=job.failure_reason,
        waiting_for=job.waiting_for,
    )


def job_summary(job: JobView) -> JobSummary:
    return JobSummary(**_summary_fields(job))  # type: ignore[arg-type]


def job_detail(job: JobView, spec: JobSpec | None = None) -> JobDetail:
    """`spec`: the job's spec as the reader may see it (redact.spec_for); default as is."""
    return JobDetail(
        **_summary_fields(job),  # type: ignore[arg-type]
        spec=job.spec if spec is None else spec, children=list(job.children),
        tasks=[task_out(t) for t in job.tasks],
    )


def worker_out(w: WorkerView, last_heartbeat: float | None, healthy: bool,
               stats: Sequence[DeviceStats] = ()) -> WorkerOut:
    now = {s.index: s for s in stats}
    empty = DeviceStats(index=-1)
    return WorkerOut(
        worker_id=w.worker_id, incarnation=w.incarnation, host=w.host, healthy=healthy,
        resources=w.resources, cpu_free=w.free.cpu / 1000,
        memory_free_mb=w.free.mem, disk_free_mb=w.free.disk,
        devices_free=min(w.free.dev, len(w.free_devices)),  # out of service: not free
        address=w.address, held_by_gang=w.holder, attributes=w.attributes,
        registered_at=w.registered_at, last_heartbeat=last_heartbeat,
        running_attempts=sorted(w.live_attempts),
        devices=[DeviceOut(d.index, d.uuid, d.model, d.memory_mb, w.devices_used.get(d.index),
                           w.unhealthy.get(d.index), s.utilization, s.memory_used_mb,
                           s.temperature_c)
                 for d in w.devices for s in (now.get(d.index, empty),)],
        out_of_service=w.out_of_service,
        drain_deadline=w.drain_deadline if w.draining else None,
        recent_failures=len(w.failures),
    )


class ScheduleOut(msgspec.Struct):
    """A schedule (docs/lifecycle.md, "Schedules"): next_run is epoch seconds, None once
    cancelled."""

    schedule_id: str
    name: str
    user: str
    cron: str
    timezone: str
    created_at: float
    next_run: float | None
    fired: int
    last_fire_at: float | None
    last_job: str | None
    cancelled_at: float | None


def schedule_out(s: ScheduleView, now: float) -> ScheduleOut:
    spec = s.spec.schedule
    cron, zone = (spec.cron, spec.timezone) if spec is not None else ("", "UTC")
    since = max(now, s.created_at, s.last_fire_at)
    next_run = None if s.cancelled_at or spec is None else schedules.next_fire(cron, zone, since)
    return ScheduleOut(
        schedule_id=s.schedule_id, name=s.spec.name, user=s.spec.user, cron=cron,
        timezone=zone, created_at=s.created_at, next_run=next_run, fired=s.fired,
        last_fire_at=s.last_fire_at or None, last_job=s.last_job or None,
        cancelled_at=s.cancelled_at or None)
class QuotaOut(msgspec.Struct):
    """One user's quota (each dimension its own, else the default; None: no limit) and what
    its live attempts hold (cpu in millicores, memory in MiB)."""

    user: str
    cpu: int | None
    mem: int | None
    dev: int | None
    cpu_used: int
    mem_used: int
    dev_used: int


class TokenOut(msgspec.Struct):
    name: str
    limit: int
    in_use: int


class LimitsOut(msgspec.Struct):
    """Every quota and token limit in force (docs/placement.md "Quotas", docs/lifecycle.md
    "Tokens"): `default` is every user's quota unless set for them; `users` lists each user
    with a quota of its own or anything in use."""

    default: QuotaOut
    users: list[QuotaOut]
    tokens: list[TokenOut]


def limits_out(limits: Limits, usage: Usage) -> LimitsOut:
    def quota(user: str, q: Quota) -> QuotaOut:
        used = usage.users.get(user, Amounts())
        return QuotaOut(user, q.cpu, q.mem, q.dev, used.cpu, used.mem, used.dev)

    users = sorted(set(limits.quotas) | set(usage.users))
    return LimitsOut(
        default=quota("*", limits.default),
        users=[quota(u, limits.quota(u)) for u in users],
        tokens=[TokenOut(name, limits.tokens.get(name, 0), usage.tokens.get(name, 0))
                for name in sorted(set(limits.tokens) | set(usage.tokens))])
