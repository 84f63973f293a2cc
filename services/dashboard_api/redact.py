"""A job spec's `env` is where people put secrets: only an admin and the job's own user see
its values; every other reader (read tokens, other submitters, anonymous) sees the keys
with REDACTED for each value. Every path that hands a spec to an HTTP reader goes through
here: the job detail, and the JobSubmitted events of the live stream."""

from __future__ import annotations

import msgspec

from berth.services.dashboard_api.auth import Caller
from berth.shared.messages import JobSpec, JobSubmitted, encode, event_decoder

REDACTED = "<redacted>"


class _Tagged(msgspec.Struct):
    type: str = ""


_tag_decoder = msgspec.json.Decoder(_Tagged)


def sees_env(who: Caller | None, user: str) -> bool:
    return who is not None and who.owns(user)


def spec_for(who: Caller | None, spec: JobSpec) -> JobSpec:
    if not spec.env or sees_env(who, spec.user):
        return spec
    return msgspec.structs.replace(spec, env=dict.fromkeys(spec.env, REDACTED))


def event_for(who: Caller | None, data: bytes) -> bytes | None:
    """An events-stream message as `who` may see it; None for one that cannot be read (it
    may hold a spec that cannot be checked, so it is not sent at all)."""
    # Only a job_submitted event holds a spec. The tag is read by decoding, not by looking
    # for bytes, so no spelling of the JSON (escapes, order) slips a spec past.
    try:
        tag = _tag_decoder.decode(data).type
    except msgspec.DecodeError:
        return None
    if tag != "job_submitted":
        return data
    try:
        event = event_decoder.decode(data)
    except msgspec.DecodeError:
        return None
    if not isinstance(event, JobSubmitted):
        return None
    shown = spec_for(who, event.spec)
    if shown is event.spec:
        return data
    return encode(msgspec.structs.replace(event, spec=shown))
