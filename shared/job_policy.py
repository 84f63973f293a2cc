"""What a submit with `existing` or `dedup` does, as a pure rule over the jobs it may
collide with (docs/lifecycle.md, "Existing jobs and dedup"). The submitter gathers those
jobs from its fold of the log (services/submitter/index.py) and applies `resolve`."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from berth.shared.messages import DedupPolicy, ExistingPolicy, JobSpec
from berth.shared.states import JOB_TERMINAL, JobState

_canonical = msgspec.json.Encoder(order="sorted")


def spec_hash(spec: JobSpec) -> str:
    """The identity of what a spec runs (experimaestro's configuration hash): its canonical
    JSON (keys sorted, defaults included) without the fields that only say what to do on a
    collision. The user is part of it, so two users' identical specs are two jobs."""
    plain = msgspec.structs.replace(spec, existing=None, dedup=None)
    return hashlib.sha256(_canonical.encode(plain)).hexdigest()


@dataclass(frozen=True)
class Known:
    """A job already made (or being made) that a submit may collide with."""

    job_id: str
    state: JobState


@dataclass(frozen=True)
class Verdict:
    """New: submit the job (cancelling `replaces` first); `same` set: no new job, the
    submit resolves to that existing one (`how`: kept or deduplicated); `error` set: reject."""

    replaces: list[str] = field(default_factory=list)
    same: str = ""
    how: str = ""
    error: str = ""


def reusable(state: JobState) -> bool:
    """Whether a job of an identical spec stands for a new submit: one that is still going
    or succeeded (a failed or killed one is run again, as experimaestro does)."""
    return state not in JOB_TERMINAL or state == JobState.SUCCEEDED


def resolve(spec: JobSpec, same_name: list[Known], same_spec: list[Known]) -> Verdict:
    """The verdict on a submit of `spec`, given the user's jobs of the same name and those of
    an identical spec (each oldest first). `dedup` is asked first: an identical job makes
    the name question moot."""
    if spec.dedup == DedupPolicy.SPEC:
        for known in reversed(same_spec):
            if reusable(known.state):
                return Verdict(same=known.job_id, how="deduplicated")
    live = [k for k in same_name if k.state not in JOB_TERMINAL]
    if not live or spec.existing is None:
        return Verdict()
    if spec.existing == ExistingPolicy.ERROR:
        first = live[0]
        return Verdict(error=f"existing: job {spec.name!r} is already {first.job_id} "
                       f"({first.state.display}); cancel it, or submit with existing: keep "
                       "or recreate")
    if spec.existing == ExistingPolicy.KEEP:
        return Verdict(same=live[-1].job_id, how="kept")
    return Verdict(replaces=[k.job_id for k in live])


def in_words(how: str, job_id: str) -> str:
    """What a submit resolved to an existing job did, as `berth submit` and the API say it."""
    return f"{'deduplicated to' if how == 'deduplicated' else 'kept existing'} {job_id}"


def recreated_words(replaced: Sequence[str]) -> str:
    return f"recreated: cancelled {', '.join(replaced)}" if replaced else ""
