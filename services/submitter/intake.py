"""Turning one raw submit message into an outcome event: pure, so every rule is testable
without a server. Never raises on input."""

from __future__ import annotations

import time
from typing import TypeVar

import msgspec

from berth.shared.job_ids import job_id_for
from berth.shared.messages import (
    JobCancelRequested,
    JobSubmitted,
    SubmitRejected,
    cancel_decoder,
    decode,
    job_spec_decoder,
)

# Spec-file fields that `berth submit` resolves before sending (berth/workspace.py).
CLIENT_FIELDS = {"workspace": "pack and upload the directory, then send its digest as "
                 "`bundle`", "env_file": "send its values in `env`"}


def describe_error(exc: Exception, what: str = "job spec") -> str:
    if isinstance(exc, msgspec.ValidationError):
        text = f"invalid {what}: {exc}"
        for field, instead in CLIENT_FIELDS.items():
            if f"unknown field `{field}`" in text:
                text += (f" ({field} is read by `berth submit`; another client should "
                         f"{instead}: docs/protocol.md)")
        return text
    return f"malformed JSON: {exc}"


T = TypeVar("T")


def _decode(payload: bytes, submit_seq: int, max_bytes: int, decoder: msgspec.json.Decoder[T],
            what: str, now: float) -> T | SubmitRejected:
    """The message as `decoder`'s type, or a rejection that says what is wrong with it."""
    if len(payload) > max_bytes:
        return SubmitRejected(
            submit_seq=submit_seq,
            reason=f"submit message is {len(payload)} bytes; the limit is {max_bytes} bytes",
            ts=now,
        )
    try:
        return decode(decoder, payload)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        return SubmitRejected(submit_seq=submit_seq, reason=describe_error(exc, what), ts=now)


def _not_yours(submit_seq: int, given: str, user: str, now: float) -> SubmitRejected:
    return SubmitRejected(
        submit_seq=submit_seq, ts=now,
        reason=f"user: {given!r} is not who you are ({user!r}); leave it out or set it to "
        f"{user!r}")


def intake(
    payload: bytes, submit_seq: int, stored_at_ns: int, max_bytes: int,
    user: str | None = None,
) -> JobSubmitted | SubmitRejected:
    """A message on berth.submit.job (user None: the admin-only bare subject, the spec's
    `user` taken as given) or berth.submit.job.<user> (the job is that user's, whatever
    the spec says). A named parent still has to be checked to exist."""
    now = time.time()
    spec = _decode(payload, submit_seq, max_bytes, job_spec_decoder, "job spec", now)
    if isinstance(spec, SubmitRejected):
        return spec
    if user is not None:
        if spec.user not in ("", user):
            return _not_yours(submit_seq, spec.user, user, now)
        spec = msgspec.structs.replace(spec, user=user)
    return JobSubmitted(
        job_id=job_id_for(submit_seq, stored_at_ns), submit_seq=submit_seq, spec=spec, ts=now
    )


def intake_cancel(payload: bytes, submit_seq: int, max_bytes: int, user: str | None = None
                  ) -> JobCancelRequested | SubmitRejected:
    """A message on berth.submit.cancel[.<user>]. The job still has to be checked to exist
    (and, for a user, to be theirs)."""
    now = time.time()
    request = _decode(payload, submit_seq, max_bytes, cancel_decoder, "cancel request", now)
    if isinstance(request, SubmitRejected):
        return request
    if user is not None and request.user not in ("", user):
        return _not_yours(submit_seq, request.user, user, now)
    return JobCancelRequested(job_id=request.job_id, submit_seq=submit_seq,
                              reason=request.reason, user=user or request.user, ts=now)


def unknown_subject(subject: str, submit_seq: int) -> SubmitRejected:
    return SubmitRejected(
        submit_seq=submit_seq,
        reason=f"unknown submit subject {subject!r}: publish jobs to berth.submit.job.<user> "
        "and cancels to berth.submit.cancel.<user>",
        ts=time.time(),
    )
