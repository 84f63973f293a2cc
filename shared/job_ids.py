"""The job-id format, `j<submit seq>-<4 hex>`: built by the submitter, validated where a
message carries one, parsed back to its submit sequence. Only here."""

from __future__ import annotations

import hashlib
import re

PATTERN = r"^j[0-9]+-[0-9a-f]{4}$"
# A schedule's id: the same form with an `s`, from the submit that made it.
SCHEDULE_PATTERN = r"^s[0-9]+-[0-9a-f]{4}$"
# What a cancel may name: a job or a schedule.
CANCELLABLE_PATTERN = r"^[js][0-9]+-[0-9a-f]{4}$"
_MATCH = re.compile(CANCELLABLE_PATTERN)


def job_id_for(submit_seq: int, stored_at_ns: int) -> str:
    """Deterministic, so a redelivered submit gets the same id (and the same event dedup
    id); the digest of the stored time keeps ids unique if the submit stream is recreated."""
    digest = hashlib.sha1(f"{stored_at_ns}:{submit_seq}".encode()).hexdigest()[:4]
    return f"j{submit_seq}-{digest}"


def schedule_id_for(submit_seq: int, stored_at_ns: int) -> str:
    return "s" + job_id_for(submit_seq, stored_at_ns)[1:]


def is_schedule_id(some_id: str) -> bool:
    return some_id.startswith("s")


def submit_seq_of(job_id: str) -> int | None:
    """The submit sequence a job (or schedule) id was derived from, or None if it is not
    one."""
    if not _MATCH.match(job_id):
        return None
    return int(job_id[1:job_id.index("-")])
