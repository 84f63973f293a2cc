"""The cluster state as a fold of the events stream.

`ClusterState.apply(seq, event)` is deterministic and idempotent: the scheduler, the dashboard
and the checker all fold the same log through it, so they cannot disagree, and a redelivered
or duplicated event changes nothing. It returns the side effects the scheduler must carry
out (release a reservation, kill a process); a pure projection ignores them.
"""

from __future__ import annotations

import bisect
import operator
from collections import deque
from typing import Generic, TypeVar, overload

import msgspec

from berth.shared import limits as limit_rules
from berth.shared import node_health, task_rules
from berth.shared import usage as recent
from berth.shared.capacity import Amounts
from berth.shared.event_origin import epoch_refusal
from berth.shared.messages import (
    EMPTY,
    AnyEvent,
    AttemptReported,
    AttemptsReported,
    DeviceHealthChanged,
    DeviceInfo,
    GpuTelemetry,
    JobCancelRequested,
    JobsCompacted,
    JobSpec,
    JobSubmitted,
    LeaderElected,
    NodeAction,
    NodeHealthChanged,
    PendingReasonsChanged,
    PreemptionReleased,
    QuotaSet,
    Resources,
    ResourceUse,
    RetryEvent,
    ScheduleCreated,
    StopCriteria,
    SubmitDeduplicated,
    SubmitRejected,
    TaskAssigned,
    TasksAssigned,
    TasksPreempted,
    TaskUnschedulable,
    TokenLimitSet,
    WorkerDeclaredDead,
    WorkerRegistered,
    WorkerStopped,
    attempt_key,
    parse_attempt_key,
)
from berth.shared.states import (
    ATTEMPT_LIVE,
    JOB_TERMINAL,
    PROCESS_ENDED,
    JobState,
    JobStates,
    TaskState,
    TaskStates,
)

S = TaskStates  # TaskState's members, looked up faster (states.TaskStates)
J = JobStates
MASTER_DONE = StopCriteria.MASTER_DONE  # looked up for every task's change of state
MAX_REFUSALS_KEPT = 20
# Attempt keys assigned twice kept for the checker: one is already a violation.
MAX_REUSES_KEPT = 20
# Preemption event ids remembered: a leader folds its own event at once and again when the
# log delivers it, at most a tick's preemptions (200) and their releases later; far more
# than that may pass in between only if the log is that far behind.
PREEMPTION_IDS_KEPT = 4096
# Versions of the limits kept for judging assignments committed against an older one (a
# commit names the version it was checked against; limits change rarely).
MAX_LIMIT_VERSIONS = 32


_ABSENT = object()


class AttemptView(msgspec.Struct, kw_only=True, gc=False):
    attempt_id: int
    worker_id: str
    incarnation: str
    state: TaskState = S.ASSIGNED
    assigned_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    exit_code: int | None = None
    error: str = ""
    # The process is confirmed gone (worker report, or worker declared dead/stopped): only
    # then are its resources released (docs/invariants.md, invariant 3).
    exited: bool = False
    kill_requested: bool = False
    # Seconds from SIGTERM to SIGKILL its kill gives (a preempted attempt's grace), or None.
    kill_grace: float | None = None
    worker_failure: bool = False
    ports: dict[str, int] = {}
    group: str = ""
    coordinator: str = ""
    devices: tuple[int, ...] = ()  # indices of the worker's devices it holds
    gpu: GpuTelemetry | None = None  # what it used of them, from its exit report
    usage: ResourceUse | None = None  # what its process tree used, from its exit report


class TaskMore(msgspec.Struct, kw_only=True, gc=False):
    """What a task keeps only once it is retried, preempted, resumed, refused or voided:
    most tasks never are, and every fold keeps every task (docs/performance.md, "What a
    waiting and a finished job cost"). TaskView reads and writes these as its own attributes."""

    failure_count: int = 0
    preemption_count: int = 0
    # Runtime timeouts of a resumable task that were retried (its `max_resumes` budget).
    resume_count: int = 0
    # Brought down because another gang member failed terminally: finished, whatever its
    # own counters say (they count only its own attempts).
    stopped_with_gang: bool = False
    # Under the job's retry policy (task_rules.retry_plan), all from event timestamps in
    # the log: its retries so far (the backoff's exponent), when its retry window opened,
    # and the time before which it may not be placed (0: none). A new leader derives the
    # same wait, so a fail-over neither shortens nor restarts it.
    retries: int = 0
    retry_since: float | None = None
    retry_at: float = 0.0
    # Its policy's duration ran out: finished, whatever its budgets say.
    retries_ended: bool = False
    refused_reports: tuple[str, ...] = ()  # the newest MAX_REFUSALS_KEPT
    # The highest attempt id a deposed leader's late (void) assignment used, -1 if none: its
    # command may have reached a worker, which never starts an attempt key twice, so no
    # later attempt may take that id (docs/reliability.md, "Late assignments").
    burned_attempt_id: int = -1


_NO_MORE = TaskMore()  # read-only: what a task without its own TaskMore reads
T = TypeVar("T")


class _More(Generic[T]):
    """A TaskView attribute kept in its TaskMore: reads the default until one is set. Some
    are read for every assignment, so the default and the getter are looked up once."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.default: T = getattr(_NO_MORE, name)
        self.get = operator.attrgetter(name)

    @overload
    def __get__(self, task: None, owner: type) -> _More[T]: ...
    @overload
    def __get__(self, task: TaskView, owner: type) -> T: ...
    def __get__(self, task: TaskView | None, owner: type) -> T | _More[T]:
        if task is None:
            return self
        more = task.more
        if more is None:
            return self.default
        value: T = self.get(more)
        return value

    def __set__(self, task: TaskView, value: T) -> None:
        more = task.more
        if more is None:
            if value == self.default:
                return  # the default: nothing to keep
            more = task.more = TaskMore()
        setattr(more, self.name, value)


class TaskView(msgspec.Struct, kw_only=True, gc=False):
    job_id: str
    index: int
    state: TaskState = S.PENDING
    attempts: list[AttemptView] = []
    exit_code: int | None = None
    error: str = ""
    pending_reason: str = ""
    # When the task last became PENDING (submission or retry): scheduling_timeout counts
    # from here, so a retried task gets the full timeout again (after its backoff, if any).
    pending_since: float = 0.0
    more: TaskMore | None = None  # its rare fields, once one is set (TaskMore)

    failure_count = _More[int]()
    preemption_count = _More[int]()
    resume_count = _More[int]()
    stopped_with_gang = _More[bool]()
    retries = _More[int]()
    retry_since = _More["float | None"]()
    retry_at = _More[float]()
    retries_ended = _More[bool]()
    refused_reports = _More["tuple[str, ...]"]()
    burned_attempt_id = _More[int]()

    @property
    def key(self) -> tuple[str, int]:
        return (self.job_id, self.index)

    @property
    def current_attempt(self) -> AttemptView | None:
        """The newest attempt; `attempts` is kept sorted by attempt id."""
        return self.attempts[-1] if self.attempts else None

    def attempt(self, attempt_id: int) -> AttemptView | None:
        attempts = self.attempts
        if attempts and attempts[-1].attempt_id == attempt_id:  # nearly always: the newest
            return attempts[-1]
        for a in attempts:
            if a.attempt_id == attempt_id:
                return a
        return None

    def next_attempt_id(self, taken_elsewhere: int = -1) -> int:
        """The id of this task's next attempt: past every attempt, every id a void late
        assignment burned, and `taken_elsewhere` (the highest id Redis holds for it)."""
        newest = self.attempts[-1].attempt_id if self.attempts else -1
        return max(newest, self.burned_attempt_id, taken_elsewhere) + 1


class JobView(msgspec.Struct, kw_only=True, gc=False):
    job_id: str
    spec: JobSpec
    submit_seq: int
    submitted_at: float
    state: JobState = JobState.PENDING
    tasks: list[TaskView] = []
    started_at: float | None = None
    finished_at: float | None = None
    error: str = ""
    # Tuples, not lists: most jobs have none, and every empty tuple is the same object
    # (docs/performance.md, memory per finished job). A new child copies its parent's
    # tuple: 10,000 children of one job copy 50 million references in all (~0.1 s).
    children: tuple[str, ...] = ()
    # Jobs that name this one in `after`/`after_any` (re-checked when this one ends).
    dependents: tuple[str, ...] = ()
    # Why it ended other than by its tasks (task_rules.DEPENDENCY), or "".
    failure_reason: str = ""
    # The job its tasks wait for before they may be placed, or "".
    waiting_for: str = ""
    # How many of its tasks are in each state, kept as they change (ClusterState._set_state),
    # so that a change never walks the tasks. None for a job of one task, whose counts are
    # its task's state: most jobs have one task, and the dict was a tenth of what a
    # finished job keeps.
    state_counts: dict[TaskState, int] | None = None
    # The jobs its submit cancelled (`existing: recreate`), and the schedule that made it.
    replaced: tuple[str, ...] = ()
    schedule_id: str = ""
    # The events-stream sequence of its JobSubmitted: no message before the oldest of these
    # among the jobs still folded can concern any of them (docs/retention.md).
    first_seq: int = 0

    def counts(self) -> dict[TaskState, int]:
        """How many of its tasks are in each state (do not change it)."""
        if self.state_counts is not None:
            return self.state_counts
        return {self.tasks[0].state: 1} if self.tasks else {}

    def task_counts(self) -> dict[str, int]:
        return {state.display: n for state, n in self.counts().items()}


class ScheduleView(msgspec.Struct, kw_only=True, gc=False):
    """A schedule (docs/lifecycle.md, "Schedules"): its spec (with `schedule`) and what it
    fired, all from the log, so any leader knows which fire comes next."""

    schedule_id: str
    spec: JobSpec
    submit_seq: int
    created_at: float
    last_fire_at: float = 0.0  # the latest fire time a job was made for (0: none yet)
    fired: int = 0
    last_job: str = ""
    cancelled_at: float = 0.0


class WorkerView(msgspec.Struct, kw_only=True):
    worker_id: str
    incarnation: str
    resources: Resources
    attributes: dict[str, str] = {}
    host: str = ""
    address: str = ""
    registered_at: float = 0.0
    alive: bool = True
    used: Amounts = Amounts()
    # attempt key -> (job_id, task_index, attempt_id) of attempts holding resources here
    live_attempts: dict[str, tuple[str, int, int]] = {}
    ports_used: dict[int, str] = {}  # port -> attempt key
    holder: str | None = None  # the job whose gang holds a group this worker belongs to
    devices: list[DeviceInfo] = []  # its accelerators, one per device it offers
    devices_used: dict[int, str] = {}  # device index -> attempt key
    unhealthy: dict[int, str] = {}  # device index -> why it takes no new attempts
    # The preemptor this worker is held for, from its eviction until the preemptor is
    # placed here or lets go (as Redis's host hash says: preempt.lua, reserve.lua).
    held_for: str | None = None
    # Node health (NodeHealthChanged; kept across the worker's restarts): why it was
    # cordoned or drained (None: it was not), whether it drains and until when, why it is
    # quarantined, and the recent attempts that failed here for non-user causes.
    cordon: str | None = None
    draining: bool = False
    drain_deadline: float | None = None
    quarantine: str | None = None
    failures: list[node_health.Failure] = []

    @property
    def out_of_service(self) -> str:
        """Why it takes no new work, or "" (docs/operations.md, "Node health")."""
        return node_health.out_of_service(self.cordon, self.draining, self.quarantine)

    @property
    def free(self) -> Amounts:
        return self.resources.amounts - self.used

    @property
    def free_devices(self) -> list[int]:
        return [d.index for d in self.devices
                if d.index not in self.devices_used and d.index not in self.unhealthy]


def registered_devices(event: WorkerRegistered) -> list[DeviceInfo]:
    """A worker's devices: as it registered them, or (from a worker that predates device
    pinning, or offers TPU chips) numbered 0..count-1."""
    if event.devices:
        return list(event.devices)
    return [DeviceInfo(index=i) for i in range(event.resources.amounts.dev)]


class GroupView(msgspec.Struct, kw_only=True):
    """A coscheduling group held by a gang while any of its attempts there is live."""

    name: str
    job_id: str
    members: list[str]
    exclusive: bool
    live: list[str] = []  # attempt keys


class HoldView(msgspec.Struct, kw_only=True):
    """The hosts held for one preemptor, and the attempts it evicted for them."""

    hosts: list[str] = []
    victims: list[str] = []  # attempt keys
    since: float = 0.0
    reason: str = ""  # the preemptor's pending reason while it waits for its victims


# --- effects for the scheduler ------------------------------------------------------------


class Release(msgspec.Struct, frozen=True, gc=False):
    # Effects are Structs, not frozen dataclasses: a Release is made for every attempt's
    # exit, and a frozen dataclass's __init__ costs ~0.5 µs more.
    worker_id: str
    attempt_key: str


class Kill(msgspec.Struct, frozen=True, gc=False):
    worker_id: str
    incarnation: str
    job_id: str
    task_index: int
    attempt_id: int
    reason: str
    grace: float | None = None  # SIGTERM to SIGKILL; None: the worker's own


Effect = Release | Kill


class ClusterState:
    def __init__(self, usage_half_life: float = recent.FairShare.half_life) -> None:
        self.jobs: dict[str, JobView] = {}
        self.workers: dict[str, WorkerView] = {}
        self.rejections: dict[int, str] = {}
        self.job_by_submit: dict[int, str] = {}  # submit sequence -> job id
        self.cancel_by_submit: dict[int, str] = {}  # submit sequence -> cancelled job id
        # submit sequence -> (existing job id, "kept" or "deduplicated"): submits that made
        # no job of their own (shared/job_policy.py)
        self.same_by_submit: dict[int, tuple[str, str]] = {}
        self.schedules: dict[str, ScheduleView] = {}
        # Finished jobs the log's JobsCompacted events name (docs/retention.md), a count
        # only: remembering their ids would grow as the log no longer does.
        self.compacted_jobs = 0
        # Jobs a JobsCompacted named while an attempt of theirs was live in this fold: must
        # never happen (shared/retention.py compacts only confirmed exits); the checker
        # reports them.
        self.compacted_live: list[str] = []
        self.last_seq = 0
        self.epoch = 0
        # Messages in the log the fold did not believe (undecodable, or from a subject
        # their kind may not come from), and the newest of them.
        self.refused_events = 0
        self.last_refused_seq = 0
        # Tasks waiting for placement, in the order they became schedulable.
        self.pending: dict[tuple[str, int], None] = {}
        # What entered (True) or left (False) `pending` since a reader last cleared it, for
        # a reader that keeps an index of its own (the scheduler's pending queue): diffing
        # the whole of `pending` each tick was a sixth of the scheduler's CPU with 150,000
        # waiting. None: not kept, at no cost.
        self.pending_changes: dict[tuple[str, int], bool] | None = None
        # The workers whose view as placement sees it (alive, capacity used, ports, devices,
        # gang holder, preemptor's hold, service state) changed since a reader last cleared
        # it, for a reader that keeps its hosts between ticks (the scheduler's HostIndex):
        # comparing every worker each tick was a sixth of the scheduler's CPU at 10,000
        # hosts. None: not kept, at no cost.
        self.workers_changed: set[str] | None = None
        # Those of them a retry policy's backoff holds back: key -> the time before which
        # they may not be placed (TaskView.retry_at). Empty without retry policies, so the
        # scheduler pays nothing for it then.
        self.backoff: dict[tuple[str, int], float] = {}
        self.groups: dict[str, GroupView] = {}
        self.seen_incarnations: set[tuple[str, str]] = set()
        # Preemption holds by preemptor job id, and the ids of the newest preemption events
        # folded, oldest first (the leader folds its own at once, and again when the log
        # delivers them; a redelivery from the log is caught by its sequence). Only a
        # window is kept, or it would grow for as long as the cluster runs.
        self.holds: dict[str, HoldView] = {}
        self.preemption_events: dict[str, None] = {}
        # Attempts assigned to a host held for another job's preemption: must never happen
        # (reserve.lua refuses them); the checker reports them.
        self.taken_from_preemptor: list[str] = []
        # Attempt keys the log assigned twice, to different placements (checker: a
        # violation; the worker would never start the second).
        self.attempt_keys_reused: list[str] = []
        # Live attempts per priority rank: lets the scheduler skip preemption at once when
        # nothing running is of a band a waiting unit could evict.
        self.live_by_rank: dict[int, int] = {}
        # Quotas and token limits (admin events), their recent versions by log sequence,
        # what live attempts hold against them, and assignments that went over the version
        # they were committed against: must never happen (reserve.lua refuses them); the
        # checker reports them.
        self.limits = limit_rules.Limits()
        self.limit_versions: dict[int, limit_rules.Limits] = {0: limit_rules.Limits()}
        self.usage = limit_rules.Usage()
        self.over_limits: list[str] = []
        # Each user's recent use (shared/usage.py), for the fair-share order within a band;
        # decayed with this half-life, so a snapshot folded with another is not continued.
        self.usage_half_life = usage_half_life
        self.recent_use: dict[str, recent.UserUsage] = {}
        # Jobs to cancel (job id, reason, time, failure_reason), drained at the end of each
        # apply: a cascade through generations of children (or of dependents) is a loop,
        # never a deep recursion.
        self._cancellations: deque[tuple[str, str, float, str]] = deque()
        # The ids of jobs that ended, appended as they end, for a reader that keeps things
        # of its own per job and drops them then (the scheduler); None: not kept, at no cost.
        self.finished_jobs: list[str] | None = None
        # Each attempt an assignment made, as (job, task index, attempt), appended as made,
        # for a reader that indexes attempts of its own (the dashboard's host timeline);
        # None: not kept, at no cost.
        self.new_attempts: list[tuple[JobView, int, AttemptView]] | None = None

    # --- entry point ----------------------------------------------------------------------

    def apply(self, seq: int, event: AnyEvent | None) -> list[Effect]:
        """Folds event `seq`; None stands for a message that is not a believable event
        (shared/event_origin.py): it is counted and passed over."""
        if seq and seq <= self.last_seq:
            return []  # already folded: redelivery
        if seq:
            self.last_seq = seq
        effects: list[Effect] = []
        # The kinds are disjoint, so the order of the cases is free: the most frequent come
        # first (each case passed over is an isinstance check, for every event every
        # reader folds).
        match event:
            case AttemptReported():
                self._attempt_reported(event, effects)
            case AttemptsReported():
                for report in event.reports:  # exactly as that many reports, in order
                    self._attempt_reported(report, effects)
                    self._drain_cancellations(effects)
            case TaskAssigned() if event.epoch < self.epoch:
                self._void_assignment(event)  # a deposed leader's late assignment
            case TaskAssigned():
                self._task_assigned(event, effects)
            case TasksAssigned():
                for assigned in event.assignments:  # exactly as that many, in order
                    if assigned.epoch < self.epoch:
                        self._void_assignment(assigned)
                    else:
                        self._task_assigned(assigned, effects)
            case None:
                self.refused_events += 1
                self.last_refused_seq = seq
            case JobSubmitted():
                self._job_submitted(event, seq)
            case SubmitRejected():
                self.rejections[event.submit_seq] = event.reason
            case SubmitDeduplicated():
                self.same_by_submit[event.submit_seq] = (event.job_id, event.how)
            case ScheduleCreated():
                if event.schedule_id not in self.schedules:
                    self.schedules[event.schedule_id] = ScheduleView(
                        schedule_id=event.schedule_id, spec=event.spec,
                        submit_seq=event.submit_seq, created_at=event.ts)
            case JobCancelRequested():
                self.cancel_by_submit[event.submit_seq] = event.job_id
                if (schedule := self.schedules.get(event.job_id)) is not None:
                    # Its jobs run on: a schedule's cancel stops only its fires.
                    schedule.cancelled_at = schedule.cancelled_at or event.ts
                else:
                    who = f" by {event.user}" if event.user else ""
                    why = f": {event.reason}" if event.reason else ""
                    self._cancellations.append(
                        (event.job_id, f"cancelled{who}{why}", event.ts, ""))
            case WorkerRegistered():
                self._worker_registered(event, effects)
            case DeviceHealthChanged():
                self._device_health(event, effects)
            case NodeHealthChanged() if event.epoch and event.epoch < self.epoch:
                pass  # a deposed leader's verdict is void
            case NodeHealthChanged():
                self._node_health(event, effects)
            case WorkerDeclaredDead() if event.epoch < self.epoch:
                pass  # a deposed leader's verdict is void
            case WorkerStopped() | WorkerDeclaredDead():
                worker = self.workers.get(event.worker_id)
                if worker and worker.alive and worker.incarnation == event.incarnation:
                    worker.alive = False
                    self._worker_changed(worker.worker_id)
                    stopped = isinstance(event, WorkerStopped)
                    # Neither counts toward quarantine. A clean stop is an operator's doing;
                    # a death is a silence, and a network cut silences many healthy hosts
                    # at once (a partition on the test bed quarantined every worker).
                    self._fail_worker_attempts(worker, event.ts,
                                               "worker stopped" if stopped else "worker dead",
                                               effects)
            case LeaderElected() if epoch_refusal(event.epoch, self.epoch) is not None:
                # Only in order and in bounds: an epoch no leader could have taken would
                # void every later assignment (shared/event_origin.py).
                self.refused_events += 1
                self.last_refused_seq = seq
            case LeaderElected():
                self.epoch = event.epoch
            case TaskUnschedulable():
                if event.epoch >= self.epoch:
                    self._task_unschedulable(event, effects)
            case TasksPreempted() | PreemptionReleased() if (
                    event.epoch < self.epoch or event.id in self.preemption_events):
                pass  # a deposed leader's, or folded already
            case TasksPreempted():
                self._seen_preemption(event.id)
                self._tasks_preempted(event, effects)
            case PreemptionReleased():
                self._seen_preemption(event.id)
                self._unhold(event.job_id, event.hosts)
            case PendingReasonsChanged():
                for item in event.reasons:
                    task = self.task(item.job_id, item.task_index)
                    # A task waiting for its dependencies keeps saying so.
                    if task is not None and task.key in self.pending:
                        task.pending_reason = item.reason
            case QuotaSet():
                limit_rules.apply_quota(self.limits, event.user, event.quota, seq)
                self._new_limit_version()
            case TokenLimitSet():
                limit_rules.apply_token_limit(self.limits, event.name, event.limit, seq)
                self._new_limit_version()
            case JobsCompacted():
                # No epoch check: which jobs were finished with every exit confirmed is a
                # fact of the log, whoever wrote it; and a reader that misses it could keep
                # a job whose later events were purged as pending.
                self._jobs_compacted(event.job_ids, effects)
                if seq:  # counted as the log has it (a leader applies its own at seq 0 first)
                    self.compacted_jobs += len(event.job_ids)
        if self._cancellations:  # rarely: a call per event saved
            self._drain_cancellations(effects)
        return effects

    def _drain_cancellations(self, effects: list[Effect]) -> None:
        while self._cancellations:
            job_id, reason, ts, failure_reason = self._cancellations.popleft()
            self._cancel(job_id, reason, ts, effects, failure_reason)

    def _seen_preemption(self, event_id: str) -> None:
        self.preemption_events[event_id] = None
        if len(self.preemption_events) > PREEMPTION_IDS_KEPT:
            del self.preemption_events[next(iter(self.preemption_events))]

    def _new_limit_version(self) -> None:
        self.limit_versions[self.limits.seq] = msgspec.structs.replace(
            self.limits, quotas=dict(self.limits.quotas), tokens=dict(self.limits.tokens))
        while len(self.limit_versions) > MAX_LIMIT_VERSIONS:
            del self.limit_versions[min(self.limit_versions)]

    def task(self, job_id: str, index: int) -> TaskView | None:
        job = self.jobs.get(job_id)
        if job is None or not 0 <= index < len(job.tasks):
            return None
        return job.tasks[index]

    # --- handlers -------------------------------------------------------------------------

    def _jobs_compacted(self, job_ids: list[str], effects: list[Effect]) -> None:
        """Drops each job and everything its events built, whatever those were. A reader
        that folded its submit but not its later (purged) events sees it unfinished: any
        attempt it still thinks live is let go first, so its host is free in this fold as
        it is in the log the compactor folded."""
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is None:
                continue
            for task in job.tasks:
                self._unqueue(task)
                for attempt in task.attempts:
                    if attempt.exited:
                        continue
                    key = attempt_key(job_id, task.index, attempt.attempt_id)
                    worker = self.workers.get(attempt.worker_id)
                    if (worker is not None and key in worker.live_attempts
                            and len(self.compacted_live) < MAX_REUSES_KEPT):
                        self.compacted_live.append(f"{key} on {attempt.worker_id}")
                    self._attempt_exited(attempt, job_id, task.index, effects)
            del self.jobs[job_id]
            if self.job_by_submit.get(job.submit_seq) == job_id:
                del self.job_by_submit[job.submit_seq]
            for dep_id in {*job.spec.after, *job.spec.after_any}:
                if (dep := self.jobs.get(dep_id)) is not None and job_id in dep.dependents:
                    dep.dependents = tuple(d for d in dep.dependents if d != job_id)
            parent = self.jobs.get(job.spec.parent or "")
            if parent is not None and job_id in parent.children:
                parent.children = tuple(c for c in parent.children if c != job_id)
        dropped = set(job_ids)
        for seq in [s for s, j in self.cancel_by_submit.items() if j in dropped]:
            del self.cancel_by_submit[seq]
        for seq in [s for s, (j, _) in self.same_by_submit.items() if j in dropped]:
            del self.same_by_submit[seq]

    def _job_submitted(self, event: JobSubmitted, seq: int = 0) -> None:
        if event.job_id in self.jobs:
            return
        for old in event.replaces:
            self._cancellations.append(
                (old, f"replaced by {event.job_id} (existing: recreate)", event.ts, ""))
        if (schedule := self.schedules.get(event.schedule_id)) is not None:
            schedule.last_fire_at = max(schedule.last_fire_at, event.fire_at)
            schedule.fired += 1
            schedule.last_job = event.job_id
        replicas = event.spec.replicas
        job = JobView(
            job_id=event.job_id,
            spec=event.spec,
            submit_seq=event.submit_seq,
            submitted_at=event.ts,
            tasks=([TaskView(job_id=event.job_id, index=0, pending_since=event.ts)]
                   if replicas == 1 else
                   [TaskView(job_id=event.job_id, index=i, pending_since=event.ts)
                    for i in range(replicas)]),  # a literal: no room to grow
            state_counts=None if replicas == 1 else {S.PENDING: replicas},
            replaced=tuple(event.replaces),
            schedule_id=event.schedule_id,
            first_seq=seq,
        )
        self.jobs[event.job_id] = job
        self.job_by_submit[event.submit_seq] = event.job_id
        for dep_id in {*event.spec.after, *event.spec.after_any}:
            dep = self.jobs.get(dep_id)
            if dep is not None:
                dep.dependents = (*dep.dependents, job.job_id)
        self._check_dependencies(job, event.ts)
        parent_id = event.spec.parent
        if parent_id is None:
            return
        parent = self.jobs.get(parent_id)
        if parent is None:  # the submitter checks; only a recreated stream gets here
            self._cancellations.append((job.job_id, f"parent job {parent_id} does not exist",
                                        event.ts, ""))
            return
        parent.children = (*parent.children, job.job_id)
        if parent.state in JOB_TERMINAL and parent.state != J.SUCCEEDED:
            self._cancellations.append(
                (job.job_id, f"parent job {parent_id} is {parent.state.display}", event.ts, ""))

    def _check_dependencies(self, job: JobView, ts: float) -> None:
        """Releases a job's tasks for placement once its dependencies allow (until then
        they stay PENDING out of `pending`, with a reason), or ends it if they never will.
        Called at submission and whenever a job it depends on ends: derived from the log
        alone, so a new leader knows exactly which jobs still wait."""
        if job.state in JOB_TERMINAL:
            return
        spec = job.spec
        if spec.after or spec.after_any:
            def states(ids: tuple[str, ...]) -> dict[str, JobState | None]:
                return {i: (d.state if (d := self.jobs.get(i)) else None) for i in ids}

            outcome, about = task_rules.dependency_outcome(
                states(spec.after), states(spec.after_any))
        else:  # most jobs, folded at every submit
            outcome, about = task_rules.DependencyOutcome.READY, ""
        if outcome == task_rules.DependencyOutcome.BROKEN:
            dep = self.jobs.get(about)
            what = dep.state.display if dep is not None else "unknown"
            self._cancellations.append(
                (job.job_id, f"dependency {about} is {what}", ts, task_rules.DEPENDENCY))
            job.waiting_for = ""
            return
        job.waiting_for = about
        for task in job.tasks:
            if task.state != S.PENDING:
                continue
            if outcome == task_rules.DependencyOutcome.READY:
                task.pending_reason = ""
                # scheduling_timeout counts from when it could first be placed.
                task.pending_since = ts
                self._enqueue(task)
            else:
                task.pending_reason = f"waiting for {about}"

    def _worker_registered(self, event: WorkerRegistered, effects: list[Effect]) -> None:
        old = self.workers.get(event.worker_id)
        if (event.worker_id, event.incarnation) in self.seen_incarnations:
            return  # this incarnation registered before; it is current or long gone
        self.seen_incarnations.add((event.worker_id, event.incarnation))
        if old is not None:
            # A new incarnation means the old agent and every process it ran are gone.
            self._fail_worker_attempts(old, event.ts, "worker restarted", effects,
                                       host_fault=True)
        worker = self.workers[event.worker_id] = WorkerView(
            worker_id=event.worker_id,
            incarnation=event.incarnation,
            resources=event.resources,
            attributes=dict(event.attributes),
            host=event.host,
            address=event.address or event.host,
            registered_at=event.ts,
            devices=registered_devices(event),
            # A restarted agent does not heal a card: it stays out until it is returned.
            unhealthy=dict(old.unhealthy) if old is not None else {},
        )
        if old is not None:
            worker.held_for = old.held_for  # Redis keeps the hold across a restart too
            # Nor a host: its cordon, drain, quarantine and failures stay with its id.
            worker.cordon, worker.draining = old.cordon, old.draining
            worker.drain_deadline, worker.quarantine = old.drain_deadline, old.quarantine
            worker.failures = old.failures
        # A group held by a gang still holds this worker if its other members keep it.
        worker.holder = next((g.job_id for g in self.groups.values()
                              if g.exclusive and worker.worker_id in g.members), None)
        self._worker_changed(worker.worker_id)

    def _worker_changed(self, worker_id: str) -> None:
        if self.workers_changed is not None:
            self.workers_changed.add(worker_id)

    def _device_health(self, event: DeviceHealthChanged, effects: list[Effect]) -> None:
        """An unhealthy device takes no new attempts, and the attempts running on it end
        as a worker failure (killed, retried under their preemption budget, never counted
        as the user's failure); they hold the device until their exit is confirmed."""
        worker = self.workers.get(event.worker_id)
        if worker is None:
            return
        self._worker_changed(worker.worker_id)
        if event.healthy:
            worker.unhealthy.pop(event.index, None)
            return
        why = f"device {event.index} of {worker.worker_id} is unhealthy: " + (
            event.reason or "unhealthy")
        worker.unhealthy[event.index] = event.reason or "unhealthy"
        key = worker.devices_used.get(event.index)
        if key is None or key not in worker.live_attempts:
            return
        self._stop_attempt_for_worker(worker, key, why, event.ts, effects,
                                      host_fault=not event.by)

    def _node_health(self, event: NodeHealthChanged, effects: list[Effect]) -> None:
        """Cordon, drain, uncordon, quarantine: whether the worker takes new work (the
        placement asks `out_of_service`). Evict: its running attempts are preempted (killed,
        retried under their preemption budget, never counted as the user's failure, nor as
        the host's)."""
        worker = self.workers.get(event.worker_id)
        if worker is None:
            return
        self._worker_changed(worker.worker_id)
        who = f"by {event.by}" if event.by else ""
        why = ": ".join(x for x in (who, event.reason) if x)
        match event.action:
            case NodeAction.CORDON:
                # The newest command wins: a cordon ends a drain (no deadline any more).
                worker.cordon, worker.draining, worker.drain_deadline = why, False, None
            case NodeAction.DRAIN:
                worker.cordon, worker.draining = why, True
                worker.drain_deadline = event.deadline
            case NodeAction.UNCORDON:
                worker.cordon, worker.draining, worker.drain_deadline = None, False, None
                worker.quarantine = None
                # Returned by an operator: what failed before does not count again.
                worker.failures = []
            case NodeAction.QUARANTINE:
                worker.quarantine = event.reason or "quarantined"
            case NodeAction.EVICT:
                reason = f"worker {worker.worker_id} drained" + (
                    f": {event.reason}" if event.reason else "")
                for key in list(worker.live_attempts):
                    self._stop_attempt_for_worker(worker, key, reason, event.ts, effects,
                                                  host_fault=False)

    def _stop_attempt_for_worker(self, worker: WorkerView, key: str, why: str, ts: float,
                                 effects: list[Effect], host_fault: bool) -> None:
        """Kills one live attempt on `worker` for the worker's sake: it ends as a worker
        failure (retried under the preemption budget) and holds its resources until its
        exit is confirmed."""
        job_id, index, attempt_id = worker.live_attempts[key]
        task = self.task(job_id, index)
        attempt = task.attempt(attempt_id) if task is not None else None
        if task is None or attempt is None or attempt.kill_requested:
            return
        job = self.jobs[job_id]
        attempt.kill_requested = True
        attempt.worker_failure = True
        attempt.error = why
        if host_fault:
            self._host_failed(worker, ts, job_id)
        effects.append(Kill(worker.worker_id, worker.incarnation, job_id, index, attempt_id,
                            why))
        if attempt is task.current_attempt and task_rules.can_transition(
                task.state, S.WORKER_FAILED):
            self._preempt(task, job, why, ts)
            self._cascade_gang(job, task, ts, effects)
            self._update_job(job, ts, effects)

    @staticmethod
    def _host_failed(worker: WorkerView, ts: float, job_id: str) -> None:
        """An attempt failed on this host through no fault of its task (the scheduler
        judges the record: node_health.quarantine_reason)."""
        worker.failures.append(node_health.Failure(ts, job_id))
        del worker.failures[:-node_health.MAX_FAILURES_KEPT]

    def _void_assignment(self, event: TaskAssigned) -> None:
        """A deposed leader's late assignment holds nothing, but its key may have reached
        a worker: the id is burned, so no later attempt of the task reuses it."""
        task = self.task(event.job_id, event.task_index)
        if task is None:
            return
        task.burned_attempt_id = max(task.burned_attempt_id, event.attempt_id)
        self._note_reuse(task, event)

    def _note_reuse(self, task: TaskView, event: TaskAssigned) -> None:
        """Records for the checker an `event` that assigns an attempt key already assigned
        elsewhere, or burned; folding the same event again is no reuse."""
        existing = task.attempt(event.attempt_id)
        if existing is not None:
            if (existing.worker_id, existing.assigned_at) == (event.worker_id, event.ts):
                return
            why = f"to {existing.worker_id} and to {event.worker_id}"
        elif event.epoch >= self.epoch and event.attempt_id <= task.burned_attempt_id:
            why = f"to {event.worker_id} after a void assignment burned the id"
        else:
            return
        why = f"{attempt_key(event.job_id, event.task_index, event.attempt_id)}: {why}"
        self.attempt_keys_reused.append(why)
        del self.attempt_keys_reused[:-MAX_REUSES_KEPT]

    def _task_assigned(self, event: TaskAssigned, effects: list[Effect]) -> None:
        task = self.task(event.job_id, event.task_index)
        worker = self.workers.get(event.worker_id)
        if task is None or worker is None:
            return
        # A burned id reused is noted but still a committed assignment, folded as one.
        self._note_reuse(task, event)
        if task.attempt(event.attempt_id) is not None:
            return  # folded already, or a second assignment of the key (noted)
        job = self.jobs[event.job_id]
        # The worker's own strings where they are equal, not the event's copies: an attempt
        # outlives its event for as long as its job is folded (docs/performance.md).
        attempt = AttemptView(
            attempt_id=event.attempt_id,
            worker_id=worker.worker_id,
            incarnation=(worker.incarnation if worker.incarnation == event.incarnation
                         else event.incarnation),
            assigned_at=event.ts,
            ports=dict(event.ports) if event.ports else EMPTY,
            group=event.group,
            coordinator=event.coordinator,
            devices=tuple(event.devices),
        )
        # A committed assignment is a fact whatever the task's state: the reservation exists
        # and the command went out, so the attempt holds resources until it is confirmed gone.
        if not task.attempts:
            task.attempts = [attempt]  # a literal: no room to grow (most tasks have one)
        else:
            bisect.insort(task.attempts, attempt, key=lambda a: a.attempt_id)
        if self.new_attempts is not None:
            self.new_attempts.append((job, task.index, attempt))
        key = attempt_key(event.job_id, event.task_index, event.attempt_id)
        spec = job.spec
        amounts = spec.resources.amounts  # read once (a property, cached by size)
        worker.used = worker.used + amounts
        worker.live_attempts[key] = (event.job_id, event.task_index, event.attempt_id)
        self._worker_changed(worker.worker_id)
        rank = spec.priority.rank
        self.live_by_rank[rank] = self.live_by_rank.get(rank, 0) + 1
        limit_rules.take(self.usage, spec.user, amounts, spec.tokens)
        version = self.limit_versions.get(event.limits_seq, self.limits)
        if over := limit_rules.over_limits(version, self.usage, spec.user, amounts,
                                           spec.tokens):
            self.over_limits += [f"{key}: {why}" for why in over]
        user = self.recent_use.get(spec.user)
        if user is None:
            user = self.recent_use[spec.user] = recent.UserUsage()
        recent.attempt_started(user, amounts, event.ts, self.usage_half_life)
        for port in event.ports.values():
            worker.ports_used[port] = key
        for index in event.devices:
            worker.devices_used[index] = key
        if event.group:
            self._hold_group(event.group, job, key)
        if worker.held_for not in (None, job.job_id):
            self.taken_from_preemptor.append(
                f"{worker.worker_id}: {key} on a host held for preemptor {worker.held_for}")
        # The preemptor has what was held for it (reserve.lua clears the same holds).
        taken = [worker.worker_id]
        if event.group and (group := self.groups.get(event.group)) is not None:
            taken += group.members
        self._unhold(job.job_id, taken)
        # The worker may have died or restarted between the placement and this event: the
        # attempt then fails at once, exactly as if it had been running (any fold order of
        # the two events gives the same state).
        gone = not worker.alive or worker.incarnation != event.incarnation
        if attempt is not task.current_attempt or job.waiting_for or not (
            task_rules.can_transition(task.state, S.ASSIGNED)
        ) or event.ts < task.retry_at:
            # Superseded, the task finished (e.g. was killed) before this was folded, its
            # job still waits for a dependency, or it is still in its retry backoff: no
            # leader offers such a task for placement (the release precedes any assignment
            # in the log; a leader places none before its retry_at, by the clock it
            # stamps the assignment with), so nothing may start early.
            attempt.kill_requested = True
            if not gone:
                effects.append(
                    Kill(worker.worker_id, worker.incarnation, job.job_id, task.index,
                         attempt.attempt_id, f"task is {task.state.display}")
                )
        else:
            self._set_state(job, task, S.ASSIGNED)
            task.pending_reason = ""
            self._unqueue(task)
            self._update_job(job, event.ts, effects)
        if gone:
            self._fail_worker_attempts(worker, event.ts, "worker gone before its assignment",
                                       effects, [key])

    def _tasks_preempted(self, event: TasksPreempted, effects: list[Effect]) -> None:
        """Holds the hosts for the preemptor, and stops the victims: each ends WORKER_FAILED
        `preempted by <job>`, retried under its preemption budget (the seed), and gets its
        job's `preemption_grace` between SIGTERM and SIGKILL. Their reservations stay
        until their exits are confirmed (invariant 3)."""
        hold = self.holds.setdefault(event.job_id, HoldView(since=event.ts))
        for worker_id in event.hosts:
            worker = self.workers.get(worker_id)
            if worker is not None:
                worker.held_for = event.job_id
                self._worker_changed(worker_id)
            if worker_id not in hold.hosts:
                hold.hosts.append(worker_id)
        why = f"preempted by {event.job_id}"
        stopped: list[tuple[JobView, TaskView]] = []
        for key in event.victims:
            if key not in hold.victims:
                hold.victims.append(key)
            job_id, index, attempt_id = parse_attempt_key(key)
            task = self.task(job_id, index)
            attempt = task.attempt(attempt_id) if task is not None else None
            if task is None or attempt is None or attempt.exited or attempt.kill_requested:
                continue
            job = self.jobs[job_id]
            attempt.kill_requested = True
            attempt.kill_grace = job.spec.preemption_grace
            attempt.worker_failure = True
            attempt.error = why
            effects.append(Kill(attempt.worker_id, attempt.incarnation, job_id, index,
                                attempt_id, why, attempt.kill_grace))
            if attempt is task.current_attempt and task_rules.can_transition(
                    task.state, S.WORKER_FAILED):
                self._preempt(task, job, why, event.ts)
                stopped.append((job, task))
        # A gang is evicted whole; should one member have run out of its preemption budget,
        # the cascade finishes its siblings as it does for any gang failure.
        for job, task in stopped:
            self._cascade_gang(job, task, event.ts, effects)
        for job in {id(j): j for j, _ in stopped}.values():
            self._update_job(job, event.ts, effects)
        victims = sorted({parse_attempt_key(k)[0] for k in hold.victims})
        hold.reason = (f"preempting {len(hold.victims)} attempts of {', '.join(victims[:4])}"
                       + (f" and {len(victims) - 4} more jobs" if len(victims) > 4 else "")
                       + ": waiting for them to stop")
        preemptor = self.jobs.get(event.job_id)
        for task in preemptor.tasks if preemptor is not None else ():
            if task.key in self.pending:
                task.pending_reason = hold.reason

    def _unhold(self, job_id: str, worker_ids: list[str]) -> None:
        """The hosts among `worker_ids` held for `job_id` are held no more."""
        hold = self.holds.get(job_id)
        if hold is None:
            return
        for worker_id in worker_ids:
            worker = self.workers.get(worker_id)
            if worker is not None and worker.held_for == job_id:
                worker.held_for = None
                self._worker_changed(worker_id)
            if worker_id in hold.hosts:
                hold.hosts.remove(worker_id)
        if not hold.hosts:
            del self.holds[job_id]

    def _task_unschedulable(self, event: TaskUnschedulable, effects: list[Effect]) -> None:
        task = self.task(event.job_id, event.task_index)
        if task is None or not task_rules.can_transition(task.state, S.UNSCHEDULABLE):
            return  # placed or ended before the timeout was folded
        job = self.jobs[event.job_id]
        plan = task_rules.retry_plan(job.spec.retry, RetryEvent.NO_CAPACITY, event.ts,
                                     task.retry_since, task.retries)
        if plan is not None:
            if event.retries != task.retries:
                return  # decided before a retry this fold has already made
            task.retries, task.retry_since = plan.retries, plan.since
            task.error = event.reason
            if plan.retry:  # it stays PENDING, held back until plan.at
                task.pending_reason = ""
                self._hold_until(task, plan.at)
                task.pending_since = plan.at
                return
            task.retries_ended = True
        self._set_state(job, task, S.UNSCHEDULABLE)
        task.error = event.reason
        task.pending_reason = ""
        self._unqueue(task)
        self._update_job(job, event.ts, effects)

    def _attempt_reported(self, event: AttemptReported, effects: list[Effect]) -> None:
        task = self.task(event.job_id, event.task_index)
        if task is None:
            return
        attempt = task.attempt(event.attempt_id)
        if attempt is None or attempt.worker_id != event.worker_id:
            self._refuse(task, f"Unknown attempt: {event.attempt_id} from {event.worker_id}")
            return
        if event.state == S.PENDING:
            return  # never regress an ASSIGNED task (the seed)
        if event.state == S.ASSIGNED:
            # Not a transition: the worker says why the attempt has not started building.
            if attempt is task.current_attempt and task.state == S.ASSIGNED and not (
                    attempt.kill_requested):
                task.pending_reason = event.waiting
            return
        if attempt.exited or attempt.state == event.state:
            # The process is already accounted for, or this state of it is: a late or
            # duplicate report (the same report published again after the dedup window).
            return
        # Facts about the process always land on its own attempt, current or not.
        attempt_path = task_rules.report_path(attempt.state, event.state)
        if attempt_path:
            if S.RUNNING in attempt_path and attempt.started_at is None:
                attempt.started_at = event.ts
            attempt.state = event.state
        if event.state in PROCESS_ENDED:
            attempt.exit_code = event.exit_code
            attempt.error = event.error
            attempt.finished_at = event.ts
            attempt.gpu = event.gpu
            attempt.usage = event.usage
            if event.worker_fault and (worker := self.workers.get(event.worker_id)):
                self._host_failed(worker, event.ts, event.job_id)
            # The process is gone whatever its state said: its resources are free.
            self._attempt_exited(attempt, event.job_id, event.task_index, effects)

        current = task.current_attempt
        assert current is not None
        if attempt is not current:
            self._refuse(task, f"Stale attempt: attempt {attempt.attempt_id} "
                               f"!= current {current.attempt_id}")
            return
        if task.state not in ATTEMPT_LIVE or attempt.kill_requested:
            # The task's state was already decided for this attempt (killed, or failed as a
            # gang sibling and requeued): the report only confirms the process's end.
            return
        if not task_rules.report_path(task.state, event.state):
            if task.state in ATTEMPT_LIVE:  # a finished task's state is simply final
                self._refuse(task, f"Invalid transition: {task.state.display} -> "
                                   f"{event.state.display} (attempt {attempt.attempt_id})")
            return
        job = self.jobs[event.job_id]
        state: TaskState = event.state
        if state == S.KILLED and event.timed_out:
            state = task_rules.timeout_outcome(job.spec.resumable, task.resume_count + 1,
                                               job.spec.max_resumes)
        before = task.state
        self._set_state(job, task, state)
        if state in PROCESS_ENDED:
            task.exit_code = event.exit_code
            task.error = event.error
        if state == S.FAILED and event.timed_out:
            task.resume_count += 1
            self._requeue(job, task, event.ts)
            self._cascade_gang(job, task, event.ts, effects)
        elif state == S.FAILED:
            task.failure_count += 1
            decision = task_rules.retry_decision(
                S.FAILED, task.failure_count, job.spec.max_retries_failure
            )
            if decision == task_rules.RetryDecision.SHOULD_RETRY:
                self._retry(job, task, RetryEvent.ERROR, event.ts)
            self._cascade_gang(job, task, event.ts, effects)
        if task_rules.job_state_may_change(before, state):
            self._update_job(job, event.ts, effects)

    # --- helpers --------------------------------------------------------------------------

    def _refuse(self, task: TaskView, why: str) -> None:
        task.refused_reports = (*task.refused_reports, why)[-MAX_REFUSALS_KEPT:]

    @staticmethod
    def _set_state(job: JobView, task: TaskView, state: TaskState) -> None:
        """Every change of a task's state goes through here, so the job's counts (from
        which its state is derived) never need a walk over its tasks."""
        if task.state == S.ASSIGNED and state != S.ASSIGNED:
            task.pending_reason = ""  # what its worker waited for is behind it
        counts = job.state_counts
        if counts is not None:
            counts[task.state] -= 1
            if not counts[task.state]:
                del counts[task.state]
            counts[state] = counts.get(state, 0) + 1
        task.state = state

    def _requeue(self, job: JobView, task: TaskView, ts: float, at: float = 0.0) -> None:
        """Back to PENDING and the placement queue; `at`: not placed before then (a
        backoff), and its scheduling_timeout counts from then."""
        self._set_state(job, task, S.PENDING)
        task.pending_since = max(ts, at)
        self._enqueue(task)
        task.retry_at = 0.0
        if at:
            self._hold_until(task, at)

    def _retry(self, job: JobView, task: TaskView, event: RetryEvent, ts: float) -> None:
        """A failed task its budget would retry: at once (the seed), or as its job's retry
        policy says, which may instead end it (its duration has run out)."""
        attempt = task.current_attempt
        ran_for = (ts - attempt.started_at
                   if attempt is not None and attempt.started_at is not None else None)
        plan = task_rules.retry_plan(job.spec.retry, event, ts, task.retry_since,
                                     task.retries, ran_for)
        if plan is None:
            self._requeue(job, task, ts)
            return
        task.retries, task.retry_since = plan.retries, plan.since
        if plan.retry:
            self._requeue(job, task, ts, plan.at)
        else:
            task.retries_ended = True

    def _hold_until(self, task: TaskView, at: float) -> None:
        task.retry_at = max(task.retry_at, at)
        if task.retry_at:  # 0 holds nothing back (the backoff lists only real waits)
            self.backoff[task.key] = task.retry_at

    def _enqueue(self, task: TaskView) -> None:
        key = task.key
        self.pending[key] = None
        if self.pending_changes is not None:
            self.pending_changes[key] = True

    def _unqueue(self, task: TaskView) -> None:
        key = task.key
        if self.pending.pop(key, _ABSENT) is not _ABSENT and self.pending_changes is not None:
            self.pending_changes[key] = False
        self.backoff.pop(key, None)

    def _attempt_exited(
        self, attempt: AttemptView, job_id: str, task_index: int, effects: list[Effect]
    ) -> None:
        attempt.exited = True
        worker = self.workers.get(attempt.worker_id)
        key = attempt_key(job_id, task_index, attempt.attempt_id)
        if worker is not None and worker.live_attempts.pop(key, None) is not None:
            spec = self.jobs[job_id].spec
            amounts = spec.resources.amounts
            worker.used = worker.used - amounts
            self._worker_changed(worker.worker_id)
            self.live_by_rank[spec.priority.rank] -= 1
            limit_rules.give_back(self.usage, spec.user, amounts, spec.tokens)
            recent.attempt_ended(self.recent_use[spec.user], amounts,
                                 attempt.assigned_at, attempt.finished_at or attempt.assigned_at,
                                 self.usage_half_life)
            for port in attempt.ports.values():
                if worker.ports_used.get(port) == key:
                    del worker.ports_used[port]
            for index in attempt.devices:
                if worker.devices_used.get(index) == key:
                    del worker.devices_used[index]
            if attempt.group:
                self._let_go_of_group(attempt.group, key)
        effects.append(Release(attempt.worker_id, key))

    def _hold_group(self, name: str, job: JobView, key: str) -> None:
        group = self.groups.get(name)
        if group is None:
            attribute, _, value = name.partition("=")
            members = sorted(w.worker_id for w in self.workers.values()
                             if w.attributes.get(attribute) == value)
            cosched = job.spec.coscheduling
            group = GroupView(name=name, job_id=job.job_id, members=members,
                              exclusive=not (cosched and cosched.shareable))
            self.groups[name] = group
            if group.exclusive:
                for member in members:
                    self.workers[member].holder = job.job_id
                    self._worker_changed(member)
        group.live.append(key)

    def _let_go_of_group(self, name: str, key: str) -> None:
        group = self.groups.get(name)
        if group is None or key not in group.live:
            return
        group.live.remove(key)
        if group.live:
            return
        del self.groups[name]
        for member in group.members:
            worker = self.workers.get(member)
            if worker is not None and worker.holder == group.job_id:
                worker.holder = None
                self._worker_changed(member)

    def _fail_worker_attempts(
        self, worker: WorkerView, ts: float, why: str, effects: list[Effect],
        keys: list[str] | None = None, host_fault: bool = False,
    ) -> None:
        """The worker's processes are gone (all of them, or those of `keys`); `host_fault`:
        through the host's fault (a death, a crash), which its record of failures counts
        once, however many attempts it took down: one incident, not one per task, or a
        single death of a busy host would quarantine it."""
        touched: dict[str, JobView] = {}
        victim = ""
        for key in list(worker.live_attempts) if keys is None else keys:
            job_id, index, attempt_id = worker.live_attempts[key]
            task = self.task(job_id, index)
            if task is None:
                continue
            attempt = task.attempt(attempt_id)
            if attempt is None:
                continue
            if not attempt.kill_requested:
                victim = victim or job_id
            attempt.state = S.WORKER_FAILED
            attempt.worker_failure = True
            attempt.error = why
            attempt.finished_at = ts
            self._attempt_exited(attempt, job_id, index, effects)
            job = self.jobs[job_id]
            if attempt is task.current_attempt and task_rules.can_transition(
                task.state, S.WORKER_FAILED
            ):
                self._preempt(task, job, why, ts)
                self._cascade_gang(job, task, ts, effects)
            touched[job_id] = job
        if host_fault and victim:
            self._host_failed(worker, ts, victim)
        for job in touched.values():
            self._update_job(job, ts, effects)

    def _cascade_gang(self, job: JobView, cause: TaskView, ts: float,
                      effects: list[Effect]) -> None:
        """A gang runs whole or not at all (the seed's coscheduled failure cascade): when one
        task fails, its running siblings are brought down as WORKER_FAILED. If the failed
        task is finished, so are they (their preemption budget is exhausted); if it is
        retried, they are retried with it, and the gang is placed whole again."""
        if job.spec.coscheduling is None:
            return
        finished = cause.state != S.PENDING
        why = cause.error or (f"exit code {cause.exit_code}" if cause.exit_code is not None
                              else "its attempt ended")
        reason = (f"gang member {cause.index} failed: {why}" if finished
                  else f"gang member {cause.index} is retried: {why}")
        for sibling in job.tasks:
            if sibling is cause:
                continue
            if finished and sibling.state == S.PENDING:
                # It can never run as part of a whole gang now.
                self._set_state(job, sibling, S.KILLED)
                sibling.error = reason
                self._unqueue(sibling)
                continue
            if sibling.state not in ATTEMPT_LIVE:
                continue
            attempt = sibling.current_attempt
            if attempt is not None and not attempt.exited:
                attempt.kill_requested = True
                effects.append(Kill(attempt.worker_id, attempt.incarnation, job.job_id,
                                    sibling.index, attempt.attempt_id, reason))
            self._preempt(sibling, job, reason, ts, exhaust=finished)
            if sibling.state == S.PENDING and cause.retry_at:
                # The gang is placed whole, so it waits out the backoff of its cause too.
                self._hold_until(sibling, cause.retry_at)

    def _preempt(self, task: TaskView, job: JobView, why: str, ts: float,
                 exhaust: bool = False) -> None:
        """WORKER_FAILED under the preemption budget: retried while it lasts (`exhaust`:
        the budget counts as used up, so the task is finished; its counter still counts
        only its own preemptions)."""
        limit = job.spec.max_retries_preemption
        self._set_state(job, task, S.WORKER_FAILED)
        task.error = why
        task.preemption_count += 1
        if exhaust:
            task.stopped_with_gang = True
            return
        decision = task_rules.retry_decision(S.WORKER_FAILED, task.preemption_count, limit)
        if decision == task_rules.RetryDecision.SHOULD_RETRY:
            self._retry(job, task, RetryEvent.INTERRUPTION, ts)

    def _cancel(self, job_id: str, reason: str, ts: float, effects: list[Effect],
                failure_reason: str = "") -> None:
        """Kills the job's unfinished tasks; the job becomes KILLED, which cancels its
        children in turn (see _update_job). A finished job is left as it is."""
        job = self.jobs.get(job_id)
        if job is None or job.state in JOB_TERMINAL:
            return
        job.error = reason
        job.failure_reason = failure_reason
        job.waiting_for = ""
        self._kill_remaining(job, reason, effects)
        self._update_job(job, ts, effects)

    def _update_job(self, job: JobView, ts: float, effects: list[Effect]) -> None:
        if job.state in JOB_TERMINAL:
            return
        if job.state_counts is None:
            new_state = task_rules.one_task_job_state(job.tasks[0].state,
                                                      job.spec.max_task_failures)
        else:
            new_state = task_rules.job_state_from_counts(
                job.state_counts, len(job.tasks), job.spec.max_task_failures)
        if task_rules.master_done(job.spec.stop_criteria == MASTER_DONE, job.tasks[0].state):
            new_state = J.SUCCEEDED
        if new_state == job.state:
            return
        job.state = new_state
        if new_state == J.RUNNING and job.started_at is None:
            job.started_at = ts
        if new_state not in JOB_TERMINAL:
            return
        job.finished_at = ts
        if self.finished_jobs is not None:
            self.finished_jobs.append(job.job_id)
        for dependent in job.dependents:
            dep = self.jobs.get(dependent)
            if dep is not None and dep.waiting_for:
                self._check_dependencies(dep, ts)
        if new_state == J.SUCCEEDED:
            # master-done: the job is done; its other tasks are stopped, not failed.
            self._kill_remaining(job, "job succeeded (stop_criteria master-done)", effects)
            return
        # Any other end (failed, unschedulable, a killed task) takes the whole job down:
        # the surviving tasks are killed and the children cancelled, as in the seed.
        job.error = job.error or self._first_error(job, new_state)
        self._kill_remaining(job, f"job {new_state.display}", effects)
        for child_id in job.children:
            self._cancellations.append(
                (child_id, f"parent job {job.job_id} {new_state.display}", ts, ""))

    @staticmethod
    def _first_error(job: JobView, state: JobState) -> str:
        cause = next((t for t in job.tasks if t.state.value == state.value and t.error), None)
        if cause is None:
            return f"job {state.display}"
        return f"job {state.display}: task {cause.index}: {cause.error}"

    def _kill_remaining(self, job: JobView, reason: str, effects: list[Effect]) -> None:
        for task in job.tasks:
            if not task_rules.can_transition(task.state, S.KILLED):
                continue
            self._set_state(job, task, S.KILLED)
            task.error = reason
            task.pending_reason = ""
            self._unqueue(task)
            attempt = task.current_attempt
            if attempt is not None and not attempt.exited:
                attempt.kill_requested = True
                effects.append(
                    Kill(attempt.worker_id, attempt.incarnation, job.job_id, task.index,
                         attempt.attempt_id, reason)
                )
