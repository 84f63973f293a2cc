"""Which of a worker's attempt reports go out together, and as what message: the rules of
BERTH_REPORT_COALESCE (docs/protocol.md, "Attempt reports"), apart from any transport.
Pure functions over plain data; services/worker_agent/report_sender.py carries them out."""

from __future__ import annotations

import hashlib

import msgspec

from berth.shared import bounded, pacing
from berth.shared.messages import AttemptReported, AttemptsReported, attempt_key, encode


def send_at(now: float, last_sent: float | None, window: float, alone: bool = False
            ) -> float:
    """When a report made at `now`, with none waiting, goes out: as shared/pacing.py's
    `next_at` says for this worker's messages (at once after `window` of quiet, else when
    the window since its last message ends, with whatever else was made by then). A
    `window` of 0 or less turns coalescing off. `alone`: the worker's last message carried
    only this report's own attempt and nothing is in flight (a lone task's exit, just after
    its RUNNING): no other attempt's report is there to share a message with, so it goes
    at once too."""
    return now if alone else pacing.next_at(now, last_sent, window)


def attempt_of(report: AttemptReported) -> str:
    return attempt_key(report.job_id, report.task_index, report.attempt_id)


def report_id(report: AttemptReported) -> str:
    """A report's dedup id (Nats-Msg-Id): one per attempt and state."""
    return f"report:{attempt_of(report)}:{report.state.name}"


def batch_id(worker_id: str, reports: list[AttemptReported]) -> str:
    """A batch's dedup id, from its entries' ids: a retried publish of the same batch is a
    duplicate, and no two batches share one (each report goes out in exactly one)."""
    digest = hashlib.sha256("\n".join(report_id(r) for r in reports).encode()).hexdigest()
    return f"reports:{worker_id}:{len(reports)}:{digest[:32]}"


def messages(worker_id: str, reports: list[AttemptReported], ts: float,
             max_bytes: int = bounded.MAX_MESSAGE_BYTES
             ) -> list[tuple[msgspec.Struct, str, int]]:
    """The messages that carry `reports` (in order), each as (event, dedup id, how many of
    the reports it carries): consecutive runs under `max_bytes`, a run of one as the plain
    `attempt_reported` it always was, a longer one as `attempts_reported`."""
    if len(reports) == 1:  # the usual case: one message, whatever its size (not encoded twice)
        return [(reports[0], report_id(reports[0]), 1)]
    out: list[tuple[msgspec.Struct, str, int]] = []
    for run in bounded.chunks(reports, lambda r: len(encode(r)), max_bytes):
        if len(run) == 1:
            out.append((run[0], report_id(run[0]), 1))
        else:
            out.append((AttemptsReported(worker_id=worker_id, reports=run, ts=ts),
                        batch_id(worker_id, run), len(run)))
    return out
