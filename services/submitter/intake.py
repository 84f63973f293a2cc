"""Turning one raw submit message into an outcome event: pure, so every rule is testable
without a server. Never raises on input."""

from __future__ import annotations

import hashlib
import time

import msgspec

from shared.messages import (
    CancelRequest,
    JobCancelRequested,
    JobSpec,
    JobSubmitted,
    SubmitRejected,
    cancel_decoder,
    job_spec_decoder,
)


def job_id_for(submit_seq: int, stored_at_ns: int) -> str:
    """Deterministic, so a redelivered submit gets the same id (and the same event dedup
    id); the digest of the stored time keeps ids unique if the submit stream is recreated."""
    digest = hashlib.sha1(f"{stored_at_ns}:{submit_seq}".encode()).hexdigest()[:4]
    return f"j{submit_seq}-{digest}"


def describe_error(exc: Exception, what: str = "job spec") -> str:
    if isinstance(exc, msgspec.ValidationError):
        return f"invalid {what}: {exc}"
    return f"malformed JSON: {exc}"


def _too_big(payload: bytes, submit_seq: int, max_bytes: int, now: float
             ) -> SubmitRejected | None:
    if len(payload) <= max_bytes:
        return None
    return SubmitRejected(
        submit_seq=submit_seq,
        reason=f"submit message is {len(payload)} bytes; the limit is {max_bytes} bytes",
        ts=now,
    )


def intake(
    payload: bytes, submit_seq: int, stored_at_ns: int, max_bytes: int
) -> JobSubmitted | SubmitRejected:
    """A message on berth.submit.job. A named parent still has to be checked to exist."""
    now = time.time()
    if rejected := _too_big(payload, submit_seq, max_bytes, now):
        return rejected
    try:
        spec: JobSpec = job_spec_decoder.decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        return SubmitRejected(submit_seq=submit_seq, reason=describe_error(exc), ts=now)
    return JobSubmitted(
        job_id=job_id_for(submit_seq, stored_at_ns), submit_seq=submit_seq, spec=spec, ts=now
    )


def intake_cancel(payload: bytes, submit_seq: int, max_bytes: int
                  ) -> JobCancelRequested | SubmitRejected:
    """A message on berth.submit.cancel. The job still has to be checked to exist."""
    now = time.time()
    if rejected := _too_big(payload, submit_seq, max_bytes, now):
        return rejected
    try:
        request: CancelRequest = cancel_decoder.decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        return SubmitRejected(submit_seq=submit_seq,
                              reason=describe_error(exc, "cancel request"), ts=now)
    return JobCancelRequested(job_id=request.job_id, submit_seq=submit_seq,
                              reason=request.reason, user=request.user, ts=now)


def unknown_subject(subject: str, submit_seq: int) -> SubmitRejected:
    return SubmitRejected(
        submit_seq=submit_seq,
        reason=f"unknown submit subject {subject!r}: publish jobs to berth.submit.job "
        "and cancels to berth.submit.cancel",
        ts=time.time(),
    )
