"""Turning one raw submit message into an outcome event: pure, so every rule is testable
without a server. Never raises on input."""

from __future__ import annotations

import hashlib
import time

import msgspec

from shared.messages import JobSpec, JobSubmitted, SubmitRejected, job_spec_decoder


def job_id_for(submit_seq: int, stored_at_ns: int) -> str:
    """Deterministic, so a redelivered submit gets the same id (and the same event dedup
    id); the digest of the stored time keeps ids unique if the submit stream is recreated."""
    digest = hashlib.sha1(f"{stored_at_ns}:{submit_seq}".encode()).hexdigest()[:4]
    return f"j{submit_seq}-{digest}"


def describe_error(exc: Exception) -> str:
    if isinstance(exc, msgspec.ValidationError):
        return f"invalid job spec: {exc}"
    return f"malformed JSON: {exc}"


def intake(
    payload: bytes, submit_seq: int, stored_at_ns: int, max_bytes: int
) -> JobSubmitted | SubmitRejected:
    now = time.time()
    if len(payload) > max_bytes:
        return SubmitRejected(
            submit_seq=submit_seq,
            reason=f"submit message is {len(payload)} bytes; the limit is {max_bytes} bytes",
            ts=now,
        )
    try:
        spec: JobSpec = job_spec_decoder.decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        return SubmitRejected(submit_seq=submit_seq, reason=describe_error(exc), ts=now)
    return JobSubmitted(
        job_id=job_id_for(submit_seq, stored_at_ns), submit_seq=submit_seq, spec=spec, ts=now
    )
