"""Every NATS stream and subject name berth uses, in one place (documented in docs/protocol.md)."""

from __future__ import annotations

SUBMIT_STREAM = "BERTH_SUBMIT"
EVENTS_STREAM = "BERTH_EVENTS"
LOGS_STREAM = "BERTH_LOGS"

SUBMIT_JOB = "berth.submit.job"
SUBMIT_CANCEL = "berth.submit.cancel"
SUBMIT_ALL = "berth.submit.>"

EVENTS_ALL = "berth.events.>"
HEARTBEATS_ALL = "berth.heartbeat.*"
LEADER = "berth.leader"
LOGS_ALL = "berth.logs.>"

SUBMITTER_DURABLE = "submitter"


def submit_outcome(submit_seq: int) -> str:
    """Where the outcome (JobSubmitted or SubmitRejected) of submit stream message N lands."""
    return f"berth.events.submit.{submit_seq}"


PENDING_REASONS = "berth.events.pending"


def task_events(job_id: str) -> str:
    return f"berth.events.task.{job_id}"


def attempt_reports(worker_id: str) -> str:
    return f"berth.events.attempt.{worker_id}"


def worker_events(worker_id: str) -> str:
    return f"berth.events.worker.{worker_id}"


def worker_commands(worker_id: str) -> str:
    return f"berth.worker.{worker_id}.cmd"


def heartbeat(worker_id: str) -> str:
    return f"berth.heartbeat.{worker_id}"


def attempt_logs(job_id: str, task_index: int, attempt_id: int) -> str:
    return f"berth.logs.{job_id}.{task_index}.{attempt_id}"
