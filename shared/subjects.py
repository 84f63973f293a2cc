"""Every NATS stream and subject name berth uses, in one place (documented in docs/protocol.md).

Subjects carry the identity that may publish on them (a worker's id, a submitting user), so
nats-server's per-user permissions (shared/bus_permissions.py) can pin each identity to its
own subjects, and the fold can check that an event came from the one role that may write it
(shared/event_origin.py)."""

from __future__ import annotations

SUBMIT_STREAM = "BERTH_SUBMIT"
EVENTS_STREAM = "BERTH_EVENTS"
LOGS_STREAM = "BERTH_LOGS"
# Workspace bundles: a JetStream Object Store bucket (docs/workspaces.md). nats-py, and every
# other NATS client's object store API, keeps a bucket in the stream OBJ_<bucket>, object
# chunks on $O.<bucket>.C.<nuid> and each object's metadata on $O.<bucket>.M.<name>.
BUNDLES_BUCKET = "BERTH_BUNDLES"
BUNDLES_STREAM = f"OBJ_{BUNDLES_BUCKET}"
BUNDLE_CHUNKS = f"$O.{BUNDLES_BUCKET}.C.>"
BUNDLE_META = f"$O.{BUNDLES_BUCKET}.M.>"

# The bare submit subjects: only an admin identity may publish here, and the spec's `user`
# is taken as given. Everyone else publishes on the per-user subjects below.
SUBMIT_JOB = "berth.submit.job"
SUBMIT_CANCEL = "berth.submit.cancel"
SUBMIT_ALL = "berth.submit.>"
# A schedule's fires (docs/lifecycle.md, "Schedules"): only the scheduler writes here.
SUBMIT_FIRE = "berth.submit.fire"
# The outcome subjects' user token for a bare (admin) submit.
ADMIN_SUBMITTER = "_"

EVENTS_ALL = "berth.events.>"
HEARTBEATS_ALL = "berth.heartbeat.*"
LEADER = "berth.leader"
LEADER_EVENTS = "berth.events.leader"
LOGS_ALL = "berth.logs.>"
PENDING_REASONS = "berth.events.pending"
# The leader's record of which finished jobs it compacts out of the stream (docs/retention.md):
# every reader drops them from its fold here, before their own subjects are purged.
JOBS_COMPACTED = "berth.events.compacted"
# A placeholder `berth restore` stores and deletes at once, so a purged sequence of the
# backup stays a gap (berth/backup.py); never read by a service.
RESTORE_GAP = "berth.events.restore.gap"
# An operator's "compact now" request to the leader (core NATS request/reply, not stored).
ADMIN_COMPACT = "berth.admin.compact"
SUBMIT_OUTCOMES_ALL = "berth.events.submit.>"
_SUBMIT_OUTCOMES_PREFIX = SUBMIT_OUTCOMES_ALL[:-1]  # "berth.events.submit."

SUBMITTER_DURABLE = "submitter"


def submit_job(user: str | None = None) -> str:
    """Where `user` submits jobs (None: the bare, admin-only subject)."""
    return f"{SUBMIT_JOB}.{user}" if user else SUBMIT_JOB


def submit_cancel(user: str | None = None) -> str:
    return f"{SUBMIT_CANCEL}.{user}" if user else SUBMIT_CANCEL


def schedule_fire(schedule_id: str) -> str:
    """Where the leader asks for the job of a schedule's fire. One subject per schedule, so
    the leader can publish a fire only if the last one there is the one it saw."""
    return f"{SUBMIT_FIRE}.{schedule_id}"


def is_schedule_fire(subject: str) -> bool:
    return subject.startswith(SUBMIT_FIRE + ".")


def submit_user(subject: str) -> str | None:
    """The user a submit subject names: None for the bare subjects, '' for anything else
    (which is not a submit subject at all)."""
    for bare in (SUBMIT_JOB, SUBMIT_CANCEL):
        if subject == bare:
            return None
        if subject.startswith(bare + "."):
            return subject[len(bare) + 1:]
    return ""


def submit_outcome(user: str | None, submit_seq: int) -> str:
    """Where the outcome (JobSubmitted, JobCancelRequested or SubmitRejected) of submit stream
    message N from `user` lands; a submit client may read only its own user's outcomes."""
    return f"berth.events.submit.{user or ADMIN_SUBMITTER}.{submit_seq}"


def submit_outcomes(user: str | None) -> str:
    return f"berth.events.submit.{user or ADMIN_SUBMITTER}.*"


def is_submit_outcome(subject: str) -> bool:
    """Whether `subject` is one of submit_outcome's (the submitter alone writes there)."""
    return subject.startswith(_SUBMIT_OUTCOMES_PREFIX)


def submit_outcome_any_user(submit_seq: int) -> str:
    """The outcome subject of submit N whoever sent it (a purge filter: the seq is unique)."""
    return f"berth.events.submit.*.{submit_seq}"


def task_events(job_id: str) -> str:
    return f"berth.events.task.{job_id}"


ATTEMPT_REPORTS_ALL = "berth.events.attempt.*"
# A tick's assignments in one message (`tasks_assigned`): only the scheduler writes here.
ASSIGNMENTS = "berth.events.assigned"


def attempt_reports(worker_id: str) -> str:
    return f"berth.events.attempt.{worker_id}"


def worker_events(worker_id: str) -> str:
    """A worker's own events (registered, stopped): only that worker writes here."""
    return f"berth.events.worker.{worker_id}"


def worker_verdicts(worker_id: str) -> str:
    """Verdicts on a worker: the scheduler's (declared dead, quarantined, evicted at a
    drain's deadline) and an operator's (cordoned, drained, returned to service). Only the
    scheduler and an admin write here, never the worker."""
    return f"berth.events.verdict.{worker_id}"


def worker_commands(worker_id: str) -> str:
    return f"berth.worker.{worker_id}.cmd"


def heartbeat(worker_id: str) -> str:
    return f"berth.heartbeat.{worker_id}"


def attempt_logs(worker_id: str, job_id: str, task_index: int, attempt_id: int) -> str:
    """An attempt's output, under the worker that ran it (a worker may write only its own)."""
    return f"berth.logs.{worker_id}.{job_id}.{task_index}.{attempt_id}"


# The header on each attempt_logs message naming the output it is: one of LOG_STREAMS.
LOG_STREAM_HEADER = "Berth-Stream"
LOG_STREAMS = ("stdout", "stderr", "build")


def worker_logs(worker_id: str) -> str:
    """Every attempt_logs subject of one worker."""
    return f"berth.logs.{worker_id}.>"


def inbox_prefix(identity: str) -> str:
    """Each identity's replies (JetStream acks, API answers, consumer deliveries) come under
    its own inbox prefix, so no identity may read another's replies."""
    return f"_INBOX.{identity}"


# Cluster-wide limits (docs/placement.md "Quotas", docs/lifecycle.md "Tokens"): only an
# admin may write here (no other role's permissions reach berth.events.admin.>).
ADMIN_ALL = "berth.events.admin.>"
ADMIN_QUOTAS = "berth.events.admin.quota"
ADMIN_TOKENS_ALL = "berth.events.admin.tokens.*"


def admin_tokens(name: str) -> str:
    """Token `name`'s limits, one subject per token: the submitter checks that a token a
    spec asks for exists with one direct read of the newest message here."""
    return f"berth.events.admin.tokens.{name}"
