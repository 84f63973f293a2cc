"""Every message berth puts on the wire, as msgspec Structs (JSON, with a `v` schema version).

The submit message (`JobSpec`) is the public contract: `berth schema` prints its JSON Schema
so a client in any language can submit without our Python code.
"""

from __future__ import annotations

import enum
import functools
import sys
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from berth.shared import durations, job_ids, schedules
from berth.shared.capacity import Amounts
from berth.shared.states import TaskState

SCHEMA_VERSION = 1

Name = Annotated[
    str,
    Meta(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$",
        description="1-63 letters, digits, '-' and '_', starting with a letter or digit.",
    ),
]
NonNegInt = Annotated[int, Meta(ge=0)]
JobId = Annotated[
    str,
    Meta(pattern=job_ids.PATTERN, description="A job id, as berth assigned it."),
]
# A job's id names a subject (berth.events.task.<job>): one that is not a single subject
# token would make the scheduler publish where no one may, and its event publishes then
# retry for ever. A JobSubmitted that brings such an id into the fold is refused as
# undecodable (only the submitter or an admin can write one).
SubjectToken = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,128}$")]
# An attempt's key as `attempt_key` writes it: a fold parses the keys an event names, and one
# it could not parse would stop every fold of the log (refused as undecodable instead).
AttemptKey = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,128}/[0-9]{1,9}/[0-9]{1,9}$")]
Seconds = Annotated[float, Meta(gt=0, le=366 * 24 * 3600)]
User = Annotated[str, Meta(max_length=128, description="Who asked (free text).")]
Reason = Annotated[str, Meta(max_length=1024)]
BundleDigest = Annotated[
    str,
    Meta(pattern=r"^sha256:[0-9a-f]{64}$",
         description="A workspace bundle in the object store: sha256:<hex of the tar's sha256>."),
]
SetupLine = Annotated[str, Meta(min_length=1, max_length=65536)]


DeviceVariant = Annotated[
    str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$", description="e.g. h100, v5p.")
]


class CpuDevice(msgspec.Struct, tag="cpu", tag_field="type", forbid_unknown_fields=True,
                frozen=True, gc=False):
    """No accelerator."""


class GpuDevice(msgspec.Struct, tag="gpu", tag_field="type", forbid_unknown_fields=True,
                frozen=True, gc=False):
    variant: DeviceVariant
    count: Annotated[int, Meta(ge=1, le=1024)] = 1


class TpuDevice(msgspec.Struct, tag="tpu", tag_field="type", forbid_unknown_fields=True,
                frozen=True, gc=False):
    variant: DeviceVariant
    topology: Annotated[str, Meta(pattern=r"^[0-9]+(x[0-9]+){0,3}$",
                                  description="e.g. 2x2x1")] = ""
    count: Annotated[int, Meta(ge=1, le=1024, description="chips")] = 1


Device = CpuDevice | GpuDevice | TpuDevice


class Resources(msgspec.Struct, forbid_unknown_fields=True, frozen=True, gc=False):
    """What one task needs (in a job spec) or what one worker offers (at registration)."""

    cpu: Annotated[float, Meta(gt=0, le=4096, description="CPU cores, fractions allowed.")] = 1.0
    memory_mb: Annotated[int, Meta(gt=0, le=16 * 1024 * 1024, description="Memory in MiB.")] = 256
    disk_mb: Annotated[int, Meta(ge=0, le=1024 * 1024 * 1024, description="Disk in MiB.")] = 0
    device: Device = CpuDevice()

    @property
    def cpu_milli(self) -> int:
        """Redis and the placement arithmetic count whole millicores, never floats."""
        return round(self.cpu * 1000)

    @property
    def amounts(self) -> Amounts:
        return _amounts_of(self)

    @property
    def device_kind(self) -> str:
        """What a device request must match exactly: "" (none), "gpu:h100", "tpu:v5p:2x2x1"."""
        match self.device:
            case GpuDevice(variant=variant):
                return f"gpu:{variant}"
            case TpuDevice(variant=variant, topology=topology):
                return f"tpu:{variant}:{topology}"
        return ""


# Every fold reads a task's amounts at its assignment and at its exit: a hit (~0.1 µs, the
# frozen struct's hash) costs a third of building them. Clusters ask for few distinct sizes.
@functools.lru_cache(maxsize=1024)
def _amounts_of(resources: Resources) -> Amounts:
    device = resources.device
    devices = 0 if isinstance(device, CpuDevice) else device.count
    return Amounts(resources.cpu_milli, resources.memory_mb, resources.disk_mb, devices)


class Op(enum.StrEnum):
    EQ = "EQ"
    NE = "NE"
    IN = "IN"
    EXISTS = "EXISTS"
    NOT_EXISTS = "NOT_EXISTS"
    GT = "GT"
    GE = "GE"
    LT = "LT"
    LE = "LE"


class ConstraintMode(enum.StrEnum):
    """required: a worker must satisfy it. preferred: a worker that does is chosen over one
    that does not, but one that does not still takes the task."""

    REQUIRED = "required"
    PREFERRED = "preferred"


class Constraint(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True,
                 gc=False):
    """A condition on a worker attribute; a job's required constraints must all hold, its
    preferred ones rank the workers that qualify. EQ/NE compare `value`; IN takes `values`;
    GT/GE/LT/LE compare numbers; EXISTS/NOT_EXISTS take neither."""

    key: Annotated[str, Meta(min_length=1, max_length=128)]
    op: Op
    value: Annotated[str, Meta(max_length=1024)] | None = None
    # A tuple, so a constraint hashes: placement keys its per-tick caches by a task's
    # constraints, and a list here made every tick with an IN constraint raise, stopping
    # the leader and every scheduler after it on the same waiting job.
    values: tuple[Annotated[str, Meta(max_length=1024)], ...] | None = None
    mode: ConstraintMode = ConstraintMode.REQUIRED

    def __post_init__(self) -> None:
        if self.values is not None and type(self.values) is not tuple:
            msgspec.structs.force_setattr(self, "values", tuple(self.values))


# A band's rank, lowest first: read several times in each task's fold.
_PRIORITY_RANKS = {"production": 0, "interactive": 1, "batch": 2}


class Priority(enum.StrEnum):
    """Higher bands are placed first; FIFO within a band."""

    PRODUCTION = "production"
    INTERACTIVE = "interactive"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        return _PRIORITY_RANKS[self]  # a StrEnum hashes as its value; `.value` costs more


class Coscheduling(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True,
                   gc=False):
    """Place all tasks at once on workers that share one value of `group_by` (e.g. one
    `tpu-name` slice), task i on the i-th worker ordered by `order_by` (e.g. tpu-worker-id)."""

    group_by: Annotated[str, Meta(min_length=1, max_length=128)]
    order_by: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    shareable: bool = False
    """Only for jobs without accelerators: let other jobs use the group's free capacity."""


class StopCriteria(enum.StrEnum):
    """When a job may end before all its tasks do (dstack's `stop_criteria`)."""

    ALL_DONE = "all-done"
    MASTER_DONE = "master-done"


MAX_SECONDS = 366 * 24 * 3600
Duration = Annotated[
    Annotated[float, Meta(ge=0, le=MAX_SECONDS)]
    # The pattern is checked by check_retry, whose error says what a duration is; the
    # schema states it for other clients.
    | Annotated[str, Meta(max_length=32, extra_json_schema={"pattern": durations.PATTERN})],
    Meta(description=f"A duration: {durations.EXAMPLES}."),
]


class RetryEvent(enum.StrEnum):
    """What a retry policy may retry (dstack's `retry.on_events`)."""

    ERROR = "error"  # the task's process failed (FAILED): counts against max_retries_failure
    INTERRUPTION = "interruption"  # its worker failed (WORKER_FAILED): max_retries_preemption
    NO_CAPACITY = "no-capacity"  # its scheduling_timeout ran out before it was placed


class Backoff(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True,
              gc=False):
    """The wait before retry n: initial * factor^(n-1), never more than max."""

    initial: Duration = 15.0
    factor: Annotated[float, Meta(ge=1, le=100)] = 2.0
    max: Duration = 600.0

    @property
    def initial_s(self) -> float:
        return durations.parse(self.initial)

    @property
    def max_s(self) -> float:
        return durations.parse(self.max)


class RetryPolicy(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True,
                  gc=False):
    """Which events retry a task, for how long, and how long each retry waits first
    (docs/lifecycle.md, "Retry policy")."""

    on_events: Annotated[list[RetryEvent], Meta(min_length=1, max_length=3)]
    duration: Annotated[
        Duration | None,
        Meta(description="How long after a task's first retry it may still be retried "
             "(none: the retry budgets alone limit it)."),
    ] = None
    backoff: Backoff = Backoff()

    @property
    def duration_s(self) -> float | None:
        return None if self.duration is None else durations.parse(self.duration)

    def describe(self) -> str:
        """What the policy will do, in words (`berth submit` says it)."""
        b = self.backoff
        waits = f"{durations.show(b.initial_s)}"
        if b.factor > 1 and b.max_s > b.initial_s:
            waits += f", x{b.factor:g} each time up to {durations.show(b.max_s)}"
        limit = (f"for {durations.show(d)} after its first retry"
                 if (d := self.duration_s) is not None else "with no time limit")
        return (f"retries on {', '.join(e.value for e in self.on_events)} {limit}, "
                f"waiting {waits} before each")


class ExistingPolicy(enum.StrEnum):
    """What a submit does when a job of the same user and name has not finished (Iris's
    `existing_job_policy`; docs/lifecycle.md, "Existing jobs and dedup")."""

    ERROR = "error"  # reject the submit
    KEEP = "keep"  # return the existing job's id, submit nothing
    RECREATE = "recreate"  # cancel the existing job(s), then submit this one


class DedupPolicy(enum.StrEnum):
    SPEC = "spec"  # an identical spec (shared/job_policy.spec_hash) is the same job


class ScheduleSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True,
                   gc=False):
    """Run the job each time a cron expression fires (docs/lifecycle.md, "Schedules")."""

    cron: Annotated[str, Meta(min_length=1, max_length=256, description="A cron expression: "
                              "5 fields (minute hour day month weekday), or 6 with seconds "
                              "last.")]
    timezone: Annotated[str, Meta(min_length=1, max_length=64, description="An IANA time "
                                  "zone, e.g. UTC or Europe/Paris.")] = "UTC"


class ReadOnlyEmptyDict(dict[Any, Any]):
    """An empty dict that refuses every change. One of them (EMPTY) stands for the empty
    maps a fold keeps per job (a spec's env and tokens, an attempt's ports), which were 64
    bytes each; being a dict, it encodes and compares as `{}` everywhere."""

    __slots__ = ()

    def _refuse(self, *args: object, **kwargs: object) -> Any:
        raise TypeError("a shared empty map is read-only: copy it with dict() first")

    __setitem__ = __delitem__ = __ior__ = _refuse
    update = setdefault = pop = popitem = clear = _refuse


EMPTY: dict[Any, Any] = ReadOnlyEmptyDict()


_SHARED_RESOURCES: dict[Resources, Resources] = {}
_SHARED_RESOURCES_KEPT = 1024
# The longest command argument a spec shares with equal ones (sys.intern): longer ones are
# rarely repeated.
_INTERNED_ARG = 256
# JobSpec's array fields.
_SPEC_SEQUENCES = ("command", "constraints", "ports", "setup", "after", "after_any")


class JobSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True,
              gc=False):
    """The submit message: publish it as JSON to `berth.submit.job`."""

    v: Annotated[int, Meta(ge=1, le=SCHEMA_VERSION, description="Schema version.")] = 1
    name: Name
    command: Annotated[
        tuple[Annotated[str, Meta(max_length=65536)], ...],
        Meta(min_length=1, max_length=4096, description="argv of the process each task runs."),
    ]
    replicas: Annotated[int, Meta(ge=1, le=10000, description="Number of tasks.")] = 1
    env: dict[Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")], str] = {}
    resources: Resources = Resources()
    max_retries_failure: Annotated[
        int, Meta(ge=0, le=1000, description="Retries after a non-zero exit (FAILED).")
    ] = 0
    max_retries_preemption: Annotated[
        int, Meta(ge=0, le=100000, description="Retries after a worker failure.")
    ] = 100
    max_task_failures: Annotated[
        int, Meta(ge=0, description="FAILED tasks the job tolerates before it fails.")
    ] = 0
    user: User = ""
    parent: JobId | None = None
    """A parent job: if it ends in any state but succeeded, this job is cancelled."""
    scheduling_timeout: Annotated[
        Seconds | None,
        Meta(description="Seconds a task may wait for placement before it is unschedulable."),
    ] = None
    timeout: Annotated[
        Seconds | None,
        Meta(description="Seconds a task may run; then it is killed (SIGTERM, then SIGKILL)."),
    ] = None
    constraints: Annotated[tuple[Constraint, ...], Meta(max_length=64)] = ()
    priority: Priority = Priority.INTERACTIVE
    coscheduling: Coscheduling | None = None
    ports: Annotated[
        tuple[Name, ...], Meta(max_length=16, description="Named ports to allocate per task; each "
                         "task gets BERTH_PORT_<NAME>.")
    ] = ()
    bundle: Annotated[
        BundleDigest | None,
        Meta(description="The workspace bundle each task's directory is unpacked from "
             "(docs/workspaces.md); `berth submit` fills it in from `workspace`."),
    ] = None
    setup: Annotated[
        tuple[SetupLine, ...],
        Meta(max_length=256, description="Shell lines run in order with `sh -c` in the task "
             "directory before the command (the BUILDING phase); the first to fail fails the "
             "attempt."),
    ] = ()
    build_timeout: Annotated[
        Seconds | None, Meta(description="Seconds the BUILDING phase may take.")
    ] = None
    resumable: Annotated[
        bool, Meta(description="A task killed at its `timeout` is retried (it resumes from "
                   "what it saved in BERTH_TASK_DIR) instead of ending KILLED.")
    ] = False
    max_resumes: Annotated[
        int, Meta(ge=0, le=100000, description="Resumes after a timeout (with resumable).")
    ] = 10
    after: Annotated[
        tuple[JobId, ...], Meta(max_length=64, description="Jobs (your own, already submitted) "
                          "that must all succeed before this job starts; if one ends any "
                          "other way, this job ends killed with failure_reason DEPENDENCY.")
    ] = ()
    after_any: Annotated[
        tuple[JobId, ...], Meta(max_length=64, description="Jobs (your own, already submitted) "
                          "that must all have ended, in any state, before this job starts.")
    ] = ()
    stop_criteria: Annotated[
        StopCriteria, Meta(description="all-done: the job ends when all its tasks do. "
                           "master-done: it succeeds when task 0 succeeds, and its other "
                           "tasks are killed.")
    ] = StopCriteria.ALL_DONE
    preemptible: Annotated[
        bool, Meta(description="false: no job may preempt this one's tasks (only with "
                   "priority production; docs/placement.md, \"Preemption\").")
    ] = True
    preemption_grace: Annotated[
        Annotated[float, Meta(gt=0, le=3600)] | None,
        Meta(description="Seconds (at most an hour: its hosts wait for it) a preempted task "
             "has between SIGTERM and SIGKILL, to checkpoint (default: the worker's "
             "BERTH_KILL_GRACE)."),
    ] = None
    retry: Annotated[
        RetryPolicy | None,
        Meta(description="Retry by event, with a backoff between tries and a time limit "
             "(docs/lifecycle.md); without it, FAILED and WORKER_FAILED tasks are retried "
             "at once under their budgets, and a scheduling timeout is final."),
    ] = None
    existing: Annotated[
        ExistingPolicy | None,
        Meta(description="If a job of yours with this name has not finished: error rejects "
             "this submit, keep returns that job's id, recreate cancels it and submits this "
             "one (none: both run)."),
    ] = None
    dedup: Annotated[
        DedupPolicy | None,
        Meta(description="spec: if a job of yours with an identical spec is running, "
             "pending or succeeded, return its id instead of running it again."),
    ] = None
    schedule: Annotated[
        ScheduleSpec | None,
        Meta(description="Make a schedule that submits this job (without `schedule`) each "
             "time the cron expression fires; `berth schedules` lists them."),
    ] = None
    tokens: Annotated[
        dict[Name, Annotated[int, Meta(ge=1, le=1_000_000)]],
        Meta(max_length=16, description="Named cluster-wide counters each task holds while "
             "it runs (`berth tokens set NAME N`; docs/lifecycle.md, \"Tokens\"): a task "
             "is placed only when every token it asks for is free."),
    ] = {}

    def __post_init__(self) -> None:
        # Runs for every spec any reader decodes (each follower of the events stream decodes
        # every submit), so each check is guarded by what it checks being there at all:
        # most specs have no constraints, setup, ports or dependencies
        # (docs/performance.md).
        set_ = msgspec.structs.force_setattr
        # Tuples, as decoding makes them, also when built in Python from lists: a spec then
        # equals its own round trip. Tuples because a fold keeps every job's spec, and an
        # empty tuple, unlike an empty list, is one shared object (docs/performance.md).
        if not (type(self.command) is tuple and type(self.constraints) is tuple
                and type(self.ports) is tuple and type(self.setup) is tuple
                and type(self.after) is tuple and type(self.after_any) is tuple):
            for name in _SPEC_SEQUENCES:
                if type(value := getattr(self, name)) is not tuple:
                    set_(self, name, tuple(value))
        # A user's jobs all name the user, and a sweep's jobs mostly share their arguments:
        # one string each, not one per decoded spec (a fold keeps every job's spec).
        set_(self, "user", sys.intern(self.user))
        # Jobs ask for a few shapes of resources: one object for each (up to a bound, so a
        # flood of distinct shapes grows nothing).
        shared = _SHARED_RESOURCES.setdefault(self.resources, self.resources)
        if len(_SHARED_RESOURCES) > _SHARED_RESOURCES_KEPT:
            _SHARED_RESOURCES.clear()
        set_(self, "resources", shared)
        if not self.env:
            set_(self, "env", EMPTY)
        if not self.tokens:
            set_(self, "tokens", EMPTY)
        command = self.command
        set_(self, "command", tuple([
            sys.intern(arg) if len(arg) <= _INTERNED_ARG else arg for arg in command]))
        if not command[0].strip():
            raise ValueError("command: the program (command[0]) is empty")
        # One search of the joined arguments; the index only when there is one to name.
        if "\0" in "".join(command):
            i = next(i for i, arg in enumerate(command) if "\0" in arg)
            raise ValueError(f"command[{i}]: contains a NUL byte (no process argument can)")
        for key, value in self.env.items():
            if "\0" in value:
                raise ValueError(f"env.{key}: contains a NUL byte (no environment value can)")
        for c in self.constraints:
            if c.op in (Op.EQ, Op.NE, Op.GT, Op.GE, Op.LT, Op.LE) and c.value is None:
                raise ValueError(f"constraint on {c.key!r}: {c.op.value} needs a value")
            if c.op in (Op.GT, Op.GE, Op.LT, Op.LE) and parse_number(c.value) is None:
                raise ValueError(f"constraint on {c.key!r}: {c.op.value} needs a number, "
                                 f"got {c.value!r}")
            if c.op == Op.IN and not c.values:
                raise ValueError(f"constraint on {c.key!r}: IN needs a list of values")
        if self.setup:
            for i, line in enumerate(self.setup):
                if "\0" in line:
                    raise ValueError(f"setup[{i}]: contains a NUL byte (no shell line can)")
        if self.after or self.after_any:
            for field, ids in (("after", self.after), ("after_any", self.after_any)):
                if len(set(ids)) != len(ids):
                    raise ValueError(f"{field}: job ids must be unique")
        if self.ports and len(set(self.ports)) != len(self.ports):
            raise ValueError("ports: names must be unique")
        if not self.preemptible and self.priority != Priority.PRODUCTION:
            raise ValueError(f"preemptible: false is only for priority production (this job "
                             f"is {self.priority.value}, which a higher band may preempt)")
        if self.retry is not None:
            check_retry(self.retry, self.max_retries_failure, self.scheduling_timeout)
        if self.schedule is not None:
            schedules.check(self.schedule.cron, self.schedule.timezone)
        if self.coscheduling and self.coscheduling.shareable and self.resources.amounts.dev:
            raise ValueError("coscheduling.shareable: a job with accelerators holds its "
                             "group exclusively")


def check_retry(policy: RetryPolicy, max_retries_failure: int,
                scheduling_timeout: float | None) -> None:
    """A policy that could not do what it says is refused at submit, in one line."""
    if len(set(policy.on_events)) != len(policy.on_events):
        raise ValueError("retry.on_events: events must be unique")
    seconds: dict[str, float] = {}
    for field, value in (("duration", policy.duration), ("backoff.initial",
                         policy.backoff.initial), ("backoff.max", policy.backoff.max)):
        if value is None:
            continue
        try:
            seconds[field] = durations.parse(value)
        except ValueError as exc:
            raise ValueError(f"retry.{field}: {exc}") from None
        if seconds[field] > MAX_SECONDS:
            raise ValueError(f"retry.{field}: {value!r} is longer than 366 days")
    if seconds.get("duration") == 0:
        raise ValueError("retry.duration: must be more than 0 (leave it out for no limit)")
    if seconds["backoff.max"] < seconds["backoff.initial"]:
        raise ValueError(f"retry.backoff.max: {policy.backoff.max!r} is less than "
                         f"backoff.initial {policy.backoff.initial!r}")
    if RetryEvent.ERROR in policy.on_events and max_retries_failure == 0:
        raise ValueError("retry.on_events: 'error' retries nothing with max_retries_failure "
                         "0; set max_retries_failure to how many errors may be retried")
    if RetryEvent.NO_CAPACITY in policy.on_events and scheduling_timeout is None:
        raise ValueError("retry.on_events: 'no-capacity' needs a scheduling_timeout (how "
                         "long each try to place a task lasts)")


def parse_number(text: str | None) -> float | None:
    """A float from an attribute or constraint value, or None if it is not a number."""
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


class CancelRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The cancel message: publish it as JSON to `berth.submit.cancel`."""

    v: Annotated[int, Meta(ge=1, le=SCHEMA_VERSION, description="Schema version.")] = 1
    job_id: Annotated[str, Meta(pattern=job_ids.CANCELLABLE_PATTERN,
                                description="A job id, or a schedule id to cancel the "
                                "schedule (its jobs run on).")]
    reason: Reason = ""
    user: User = ""


class ScheduleFire(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The scheduler leader's request to make the job of one fire of a schedule, on the
    submit stream's subjects.schedule_fire(schedule_id): at most one per (schedule, at)."""

    v: Annotated[int, Meta(ge=1, le=SCHEMA_VERSION)] = 1
    schedule_id: Annotated[str, Meta(pattern=job_ids.SCHEDULE_PATTERN)]
    at: Annotated[float, Meta(ge=0)]


# --- events: the append-only log every service folds --------------------------------------


class Event(msgspec.Struct, tag_field="type", kw_only=True):
    v: int = SCHEMA_VERSION
    ts: float = 0.0


class JobSubmitted(Event, tag="job_submitted"):
    job_id: SubjectToken
    submit_seq: int
    spec: JobSpec
    # `existing: recreate`: the unfinished jobs of the same name this one replaces; the fold
    # cancels them as it folds this event (one event, so no reader sees one without the other).
    replaces: list[str] = []
    # Made by a schedule's fire (the schedule's id, and the fire time in epoch seconds).
    schedule_id: str = ""
    fire_at: float = 0.0


class SubmitDeduplicated(Event, tag="submit_deduplicated"):
    """A submit that made no job: an existing one stands for it (`existing: keep`, or
    `dedup: spec`); `job_id` is that job's."""

    submit_seq: int
    job_id: str
    how: str  # "kept" or "deduplicated"


class ScheduleCreated(Event, tag="schedule_created"):
    """A submit whose spec has a `schedule`: a schedule, not a job. Its id is the job id
    format with an `s` for the `j`, derived from the submit sequence in the same way."""

    schedule_id: SubjectToken
    submit_seq: int
    spec: JobSpec


class SubmitRejected(Event, tag="submit_rejected"):
    submit_seq: int
    reason: str


class JobCancelRequested(Event, tag="job_cancel_requested"):
    """An accepted cancel message: the job's unfinished tasks are killed, its children
    cancelled. Cancelling a finished job changes nothing."""

    job_id: str
    submit_seq: int
    reason: str = ""
    user: str = ""


class DeviceInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One accelerator of a worker, as it discovered it (NVML, a TPU VM's files) or was told
    (--gpu, --tpu)."""

    index: int  # NVML's index (nvidia-smi's), the order of the PCI bus; a TPU chip's number
    uuid: str = ""  # "GPU-..."; "" when not discovered
    model: str = ""  # "NVIDIA H100 80GB HBM3"; "" when not discovered
    memory_mb: int = 0

    @property
    def visible_id(self) -> str:
        """How CUDA_VISIBLE_DEVICES names it: its UUID (stable whatever CUDA's own device
        order), else its index."""
        return self.uuid or str(self.index)


class WorkerRegistered(Event, tag="worker_registered"):
    worker_id: str
    incarnation: str
    resources: Resources
    attributes: dict[str, str] = {}
    host: str = ""
    address: str = ""  # where tasks on this worker are reached (coordinator addresses)
    # Its accelerators, one per device of `resources.device`; empty from a worker that
    # predates device pinning (the fold then numbers them 0..count-1).
    devices: list[DeviceInfo] = []


class DeviceHealthChanged(Event, tag="device_health_changed"):
    """One of a worker's devices became unhealthy (an NVML error, uncorrectable ECC errors,
    gone from the bus: its worker saw it) or was returned to service (an operator's
    `berth device enable`). No new attempt is placed on an unhealthy device."""

    worker_id: str
    index: int
    healthy: bool
    reason: Reason = ""
    # Set by an operator's `berth device disable` (their name, or "operator"); empty: the
    # worker saw the device fail. An operator's choice is no fault of the host, so an
    # attempt it kills does not count toward quarantine.
    by: User = ""


class NodeAction(enum.StrEnum):
    """What an operator (`berth cordon/uncordon/drain`) or the scheduler does to a worker's
    place in service (docs/operations.md, "Node health")."""

    CORDON = "cordon"  # no new work; what runs there runs on
    DRAIN = "drain"  # no new work; what still runs at `deadline` is preempted
    UNCORDON = "uncordon"  # back in service: cordon, drain and quarantine lifted
    EVICT = "evict"  # the drain's deadline passed: its running attempts are preempted
    QUARANTINE = "quarantine"  # too many attempts failed there for non-user causes


class NodeHealthChanged(Event, tag="node_health_changed"):
    """A worker taken out of service, or returned to it. Logged on the worker's verdict
    subject, where only the scheduler and an admin may write (never the worker itself: a
    quarantined host cannot release itself). It outlives the worker's restarts."""

    worker_id: str
    action: NodeAction
    reason: Reason = ""
    by: User = ""
    # drain: when (Unix time) the attempts still running there are preempted; None: never,
    # they are waited for.
    deadline: float | None = None
    epoch: int = 0  # the scheduler's, for its own verdicts (evict, quarantine); 0: an admin


class WorkerStopped(Event, tag="worker_stopped"):
    """A worker shut down cleanly after stopping every process it ran."""

    worker_id: str
    incarnation: str


class WorkerDeclaredDead(Event, tag="worker_declared_dead"):
    """The scheduler heard no heartbeat from this worker incarnation for too long."""

    worker_id: str
    incarnation: str
    reason: str = ""
    epoch: int = 0


class LeaderElected(Event, tag="leader_elected"):
    """A scheduler took the lease. Assignments of older epochs that land after this are void."""

    scheduler_id: str
    epoch: int


class JobsCompacted(Event, tag="jobs_compacted"):
    """The leader compacts these finished jobs out of the log (docs/retention.md): every
    reader drops them, and whatever their purged events had built, when it folds this. Only
    jobs terminal for the retention period, with every attempt's exit confirmed, are named;
    that is a fact of the log up to here, so the fold believes it whatever leader wrote it."""

    job_ids: list[JobId]
    epoch: int


class CompactRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`berth admin compact`: compact now the jobs finished more than `older_than` ago."""

    older_than: Annotated[float, Meta(ge=0)]


class CompactReply(msgspec.Struct, kw_only=True):
    jobs: int = 0
    messages_before: int = 0
    messages_after: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    error: str = ""


class Quota(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Most of each resource one user's live attempts may hold at once (None: no limit of
    its own; a user's quota falls back to the default one dimension at a time)."""

    cpu: Annotated[int, Meta(ge=0, description="Millicores.")] | None = None
    mem: Annotated[int, Meta(ge=0, description="MiB.")] | None = None
    dev: Annotated[int, Meta(ge=0, description="Accelerator devices.")] | None = None


class QuotaSet(Event, tag="quota_set"):
    """An admin sets one user's quota (replacing what was set for them before), or the
    default for every user (`user` ""). Logged on subjects.ADMIN_QUOTAS, where only an
    admin may write (docs/placement.md, "Quotas")."""

    user: Annotated[str, Meta(pattern=r"^([A-Za-z0-9_-]{1,128})?$")]
    quota: Quota
    by: User = ""


class TokenLimitSet(Event, tag="token_limit_set"):
    """An admin sets how many of token `name` may be held at once (docs/lifecycle.md,
    "Tokens"). Logged on subjects.admin_tokens(name), where only an admin may write."""

    name: Name
    limit: NonNegInt
    by: User = ""


class TaskAssigned(Event, tag="task_assigned"):
    job_id: str
    task_index: int
    attempt_id: int
    worker_id: str
    incarnation: str
    epoch: int
    ports: dict[str, int] = {}
    group: str = ""  # the coscheduling group ("tpu-name=slice-a") a gang's task holds
    coordinator: str = ""  # host:port of the gang's task 0, for BERTH_COORDINATOR_ADDRESS
    # The indices of the worker's devices this attempt holds (reserved in the same Lua
    # commit as the host): one per device it asked for.
    devices: list[int] = []
    # The version (log sequence) of the quotas and token limits the commit was checked
    # against (shared/limits.py): the checker judges the assignment by those.
    limits_seq: int = 0


class TasksAssigned(Event, tag="tasks_assigned"):
    """The assignments of one tick's commit (or a chunk of them, under the message bound),
    in the order committed: read exactly as that many `task_assigned` events. Only the
    leader writes them, on their own subject; every entry carries the batch's `epoch`."""

    epoch: int
    assignments: list[TaskAssigned]


def assignments_in(event: object) -> list[TaskAssigned]:
    """The assignments `event` carries, in order (one alone, or a batch's): [] for any
    other event. For readers that look at assignments apart from the fold."""
    if isinstance(event, TaskAssigned):
        return [event]
    if isinstance(event, TasksAssigned):
        return event.assignments
    return []


class TasksPreempted(Event, tag="tasks_preempted"):
    """A pending unit of job `job_id` (a task, or a whole gang) evicts lower-band attempts
    (`victims`, attempt keys; a gang's whole), and `hosts` are held for it alone until it
    is placed there: written to Redis in one fenced commit (shared/lua/preempt.lua) before
    it is logged. The victims end WORKER_FAILED with `preempted by <job_id>`."""

    id: str  # unique: the leader folds it at once, and again when the log delivers it
    job_id: str
    victims: list[AttemptKey]
    hosts: list[str]
    epoch: int


class PreemptionReleased(Event, tag="preemption_released"):
    """The hosts held for preemptor `job_id` are let go without it being placed there (it
    ended, or could not be placed once its victims had exited)."""

    id: str  # unique, as TasksPreempted's
    job_id: str
    hosts: list[str]
    epoch: int
    reason: Reason = ""


class TaskUnschedulable(Event, tag="task_unschedulable"):
    """The scheduler gave up placing a pending task: its scheduling_timeout expired. Under
    a retry policy naming no-capacity the fold may retry it instead (shared/lifecycle.py)."""

    job_id: str
    task_index: int
    reason: str
    epoch: int
    # The task's retry count when the scheduler decided: a copy folded after that retry
    # (the leader applies its own event at once, then folds it again) changes nothing.
    retries: int = 0


class PendingReason(msgspec.Struct, frozen=True):
    job_id: str
    task_index: int
    reason: str


class PendingReasonsChanged(Event, tag="pending_reasons_changed"):
    """Why pending tasks cannot be placed, for those whose reason changed since the last one
    (published at most every BERTH_PENDING_REASON_INTERVAL seconds)."""

    reasons: list[PendingReason]
    epoch: int


class GpuTelemetry(msgspec.Struct, frozen=True, kw_only=True):
    """What an attempt's processes used of its GPUs, sampled by its worker through NVML."""

    peak_memory_mb: int  # the most GPU memory its processes held at once, all devices
    mean_utilization: float | None = None  # percent of SM time, over its samples
    peak_utilization: int | None = None
    samples: int = 0


class ResourceUse(msgspec.Struct, frozen=True, kw_only=True):
    """What an attempt's process tree used, sampled by its worker (the exit report's)."""

    cpu_seconds: float  # user + system time of every process of the tree, the reaped included
    peak_rss_mb: float  # the most resident memory the tree held at once (as sampled)
    samples: int = 0


class AttemptReported(Event, tag="attempt_reported"):
    """A worker's report of one attempt's transition: the only way a worker changes state."""

    job_id: str
    task_index: int
    attempt_id: int
    worker_id: str
    state: TaskState
    exit_code: int | None = None
    error: str = ""
    # KILLED because it ran past the task's `timeout` (a resumable task is then retried).
    timed_out: bool = False
    gpu: GpuTelemetry | None = None  # with the exit report of an attempt that had GPUs
    usage: ResourceUse | None = None  # with the exit report of an attempt that ran
    # The attempt failed through no fault of its task: the worker could not prepare or
    # start it (its disk, an error of its own). Counts toward the host's quarantine.
    worker_fault: bool = False
    # With state ASSIGNED: what the attempt waits for on its worker before it may build
    # (a build slot), shown as the task's pending_reason until it moves on.
    waiting: str = ""


class AttemptsReported(Event, tag="attempts_reported"):
    """Reports one worker made within a few milliseconds of each other, in the order it made
    them (BERTH_REPORT_COALESCE): read exactly as that many `attempt_reported` events. Every
    entry names `worker_id`, the worker whose subject carries the message."""

    worker_id: str
    reports: list[AttemptReported]


def reports_in(event: object) -> list[AttemptReported]:
    """The attempt reports `event` carries, in order (one alone, or a batch's): [] for any
    other event. For readers that look at reports apart from the fold."""
    if isinstance(event, AttemptReported):
        return [event]
    if isinstance(event, AttemptsReported):
        return event.reports
    return []


AnyEvent = (
    JobSubmitted
    | SubmitRejected
    | SubmitDeduplicated
    | ScheduleCreated
    | JobCancelRequested
    | WorkerRegistered
    | DeviceHealthChanged
    | NodeHealthChanged
    | WorkerStopped
    | WorkerDeclaredDead
    | LeaderElected
    | TaskAssigned
    | TasksAssigned
    | TaskUnschedulable
    | TasksPreempted
    | PreemptionReleased
    | PendingReasonsChanged
    | AttemptReported
    | AttemptsReported
    | QuotaSet
    | TokenLimitSet
    | JobsCompacted
)


# --- worker commands (core NATS, per-worker subject) ------------------------------------


class Command(msgspec.Struct, tag_field="type", kw_only=True):
    v: int = SCHEMA_VERSION
    epoch: int
    incarnation: str


class RunAttempt(Command, tag="run"):
    job_id: str
    task_index: int
    attempt_id: int
    command: list[str]
    env: dict[str, str]
    resources: Resources
    timeout: float | None = None
    bundle: str | None = None
    setup: list[str] = []
    build_timeout: float | None = None
    # CUDA_VISIBLE_DEVICES for the attempt: the ids (UUIDs, else indices) of exactly the
    # devices it holds (TPU chips: their indices), [] for a task that asked for none. None
    # from a scheduler that predates device pinning.
    devices: list[str] | None = None


class KillAttempt(Command, tag="kill"):
    job_id: str
    task_index: int
    attempt_id: int
    reason: str = ""
    # Seconds between SIGTERM and SIGKILL; None: the worker's BERTH_KILL_GRACE. A
    # preempted task gets its job's `preemption_grace`.
    grace: float | None = None


class ResetWorker(Command, tag="reset"):
    """To a worker incarnation the scheduler declared dead that is heard from again: its
    attempts were written off, so it kills every process and registers afresh."""

    reason: str = ""


AnyCommand = RunAttempt | KillAttempt | ResetWorker


# Seconds; at most a day, so no value can stop a worker's heartbeat (NaN is refused too).
HeartbeatInterval = Annotated[float, msgspec.Meta(ge=0, le=86400)]


class LeaderAnnouncement(msgspec.Struct, kw_only=True):
    """Broadcast on election so workers refuse commands of older epochs at once, and again
    when the leader's heartbeat pace changes."""

    v: int = SCHEMA_VERSION
    epoch: int
    scheduler_id: str
    # The heartbeat interval the leader asks for (0: none). Anyone allowed on the subject
    # could claim it, so only simulated hosts heed it here; a real worker takes it from
    # the answer to its own heartbeat (HeartbeatAck).
    heartbeat_interval: HeartbeatInterval = 0.0


class DeviceStats(msgspec.Struct, frozen=True, kw_only=True):
    """One device's figures at a heartbeat (NVML): for operators, to see an idle card."""

    index: int
    utilization: int | None = None  # percent of the last sample period the GPU was busy
    memory_used_mb: int | None = None
    temperature_c: int | None = None


class HeartbeatAck(msgspec.Struct, kw_only=True):
    """The leader's answer to a heartbeat, on the worker's own reply subject: the leader
    heard it (the worker's fence moves) and leads at `epoch`. Only a responder that got the
    request can answer it, and only the leader answers, while its lease is surely its own:
    so this is the epoch a worker may trust (docs/reliability.md)."""

    v: int = SCHEMA_VERSION
    epoch: int
    # How often the leader asks this worker to heartbeat (0: as it likes); the worker
    # clamps it (Settings.heartbeat_interval_asked).
    heartbeat_interval: HeartbeatInterval = 0.0


class Heartbeat(msgspec.Struct, kw_only=True):
    """Sent by each worker every heartbeat interval; lists the attempts it is running so the
    scheduler can reconcile (re-send lost assignments and kills)."""

    v: int = SCHEMA_VERSION
    worker_id: str
    incarnation: str
    ts: float
    attempts: list[str] = []
    # The events-stream sequence of this worker's latest report. An attempt leaves
    # `attempts` only once its exit is reported, so a scheduler whose fold has reached this
    # sequence knows every attempt missing from the list has exited or never arrived.
    reported_seq: int = 0
    # Its discovered GPUs' figures (bounded: one small entry per device offered).
    devices: list[DeviceStats] = []
    # `attempts` lists every attempt whose key k has covers_from <= k < covers_to ("" for
    # covers_to: no upper end); the defaults, every attempt. A worker with more attempts
    # than fit in one message lists them in windows over successive heartbeats
    # (shared/bounded.py window), so a heartbeat's size is bounded whatever it runs.
    covers_from: str = ""
    covers_to: str = ""

    def covers(self, key: str) -> bool:
        """Whether `attempts` would list attempt `key` if it were running."""
        return self.covers_from <= key and (not self.covers_to or key < self.covers_to)


# --- codecs --------------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()
event_decoder = msgspec.json.Decoder(AnyEvent)
command_decoder = msgspec.json.Decoder(AnyCommand)
heartbeat_decoder = msgspec.json.Decoder(Heartbeat)
leader_decoder = msgspec.json.Decoder(LeaderAnnouncement)
heartbeat_ack_decoder = msgspec.json.Decoder(HeartbeatAck)

_T = TypeVar("_T")


def decode(decoder: msgspec.json.Decoder[_T] | msgspec.msgpack.Decoder[_T], data: bytes) -> _T:
    """`decoder.decode(data)`, with every failure a msgspec.DecodeError: msgspec raises
    RecursionError for deep nesting (and MemoryError could come of absurd sizes), and no
    input may choose an error its reader does not expect."""
    try:
        return decoder.decode(data)
    except msgspec.DecodeError:
        raise
    except Exception as exc:
        raise msgspec.DecodeError(f"undecodable ({exc.__class__.__name__})") from None
job_spec_decoder = msgspec.json.Decoder(JobSpec)
cancel_decoder = msgspec.json.Decoder(CancelRequest)
fire_decoder = msgspec.json.Decoder(ScheduleFire)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def job_spec_schema() -> dict[str, Any]:
    """JSON Schema of the submit message, for clients in any language."""
    schema: dict[str, Any] = msgspec.json.schema(JobSpec)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "berth submit message (publish to berth.submit.job)"
    return schema


def cancel_schema() -> dict[str, Any]:
    schema: dict[str, Any] = msgspec.json.schema(CancelRequest)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "berth cancel message (publish to berth.submit.cancel)"
    return schema


def attempt_key(job_id: str, task_index: int, attempt_id: int) -> str:
    return f"{job_id}/{task_index}/{attempt_id}"


def parse_attempt_key(key: str) -> tuple[str, int, int]:
    """The inverse of attempt_key (job ids never contain '/')."""
    job_id, index, attempt_id = key.rsplit("/", 2)
    return job_id, int(index), int(attempt_id)
