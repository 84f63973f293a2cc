"""A ClusterState saved as bytes and loaded back, so a projection restarts from where it
was instead of folding the whole events stream again. Loading a snapshot and folding the
events after it gives exactly the state a fold from sequence 1 gives (tested)."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from berth.shared.capacity import Amounts
from berth.shared.lifecycle import (
    ClusterState,
    GroupView,
    HoldView,
    JobView,
    ScheduleView,
    WorkerView,
)
from berth.shared.limits import Limits
from berth.shared.messages import decode
from berth.shared.usage import FairShare, UserUsage

# Bumped whenever the saved shape or the fold's meaning changes: an older snapshot is then
# ignored and the projection rebuilds from sequence 1.
FORMAT = 14


class Snapshot(msgspec.Struct, kw_only=True):
    format: int
    # The events stream it was folded from ("<name>@<creation time>",
    # nats_io.events_stream_identity): a snapshot of another stream is never continued.
    stream: str
    last_seq: int
    epoch: int
    jobs: list[JobView]
    workers: list[WorkerView]
    rejections: dict[int, str]
    cancel_by_submit: dict[int, str]
    same_by_submit: dict[int, tuple[str, str]]
    schedules: list[ScheduleView]
    pending: list[tuple[str, int]]
    groups: list[GroupView]
    seen_incarnations: list[tuple[str, str]]
    refused_events: int
    last_refused_seq: int
    holds: dict[str, HoldView]
    preemption_events: list[str]
    taken_from_preemptor: list[str]
    attempt_keys_reused: list[str]
    live_by_rank: dict[int, int]
    limits: Limits
    limit_versions: dict[int, Limits]
    usage_users: dict[str, Amounts]
    usage_tokens: dict[str, int]
    over_limits: list[str]
    usage_half_life: float
    recent_use: dict[str, UserUsage]
    compacted_jobs: int
    compacted_live: list[str]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Snapshot)


def dump(state: ClusterState, stream: str) -> bytes:
    return _encoder.encode(Snapshot(
        format=FORMAT,
        stream=stream,
        last_seq=state.last_seq,
        epoch=state.epoch,
        jobs=list(state.jobs.values()),
        workers=list(state.workers.values()),
        rejections=state.rejections,
        cancel_by_submit=state.cancel_by_submit,
        same_by_submit=state.same_by_submit,
        schedules=list(state.schedules.values()),
        pending=list(state.pending),
        groups=list(state.groups.values()),
        seen_incarnations=sorted(state.seen_incarnations),
        refused_events=state.refused_events,
        last_refused_seq=state.last_refused_seq,
        holds=state.holds,
        preemption_events=list(state.preemption_events),  # oldest first
        taken_from_preemptor=state.taken_from_preemptor,
        attempt_keys_reused=state.attempt_keys_reused,
        live_by_rank=state.live_by_rank,
        limits=state.limits,
        limit_versions=state.limit_versions,
        usage_users=state.usage.users,
        usage_tokens=state.usage.tokens,
        over_limits=state.over_limits,
        usage_half_life=state.usage_half_life,
        recent_use=state.recent_use,
        compacted_jobs=state.compacted_jobs,
        compacted_live=state.compacted_live,
    ))


class UnusableSnapshot(Exception):
    """The bytes are not a snapshot this version can continue from."""


def load(data: bytes, stream: str, stream_last_seq: int,
         usage_half_life: float = FairShare.half_life) -> ClusterState:
    """The state saved in `data`, if it was folded from `stream` (whose last sequence is
    now `stream_last_seq`); else UnusableSnapshot says why."""
    try:
        snap = decode(_decoder, data)
    except msgspec.DecodeError as exc:
        raise UnusableSnapshot(f"unreadable: {exc}") from exc
    if snap.format != FORMAT:
        raise UnusableSnapshot(f"format {snap.format}, this version reads {FORMAT}")
    if snap.stream != stream:
        raise UnusableSnapshot(f"it was folded from stream {snap.stream}, the events stream "
                               f"now is {stream}")
    if snap.last_seq > stream_last_seq:
        raise UnusableSnapshot(f"it reaches event {snap.last_seq}, the stream ends at "
                               f"{stream_last_seq}")
    if snap.usage_half_life != usage_half_life:
        raise UnusableSnapshot(f"its users' usage decays with a half-life of "
                               f"{snap.usage_half_life:g} s, this one's is {usage_half_life:g} s")
    state = ClusterState(usage_half_life)
    state.last_seq = snap.last_seq
    state.epoch = snap.epoch
    state.jobs = {job.job_id: job for job in snap.jobs}
    state.job_by_submit = {job.submit_seq: job.job_id for job in snap.jobs}
    state.workers = {worker.worker_id: worker for worker in snap.workers}
    state.rejections = snap.rejections
    state.cancel_by_submit = snap.cancel_by_submit
    state.same_by_submit = snap.same_by_submit
    state.schedules = {s.schedule_id: s for s in snap.schedules}
    state.pending = dict.fromkeys(snap.pending)
    # Held back by a backoff: exactly the pending tasks with a retry_at (kept so by the fold).
    state.backoff = {key: task.retry_at for key in state.pending
                     if (task := state.jobs[key[0]].tasks[key[1]]).retry_at}
    state.groups = {group.name: group for group in snap.groups}
    state.seen_incarnations = set(snap.seen_incarnations)
    state.refused_events = snap.refused_events
    state.last_refused_seq = snap.last_refused_seq
    state.holds = snap.holds
    state.preemption_events = dict.fromkeys(snap.preemption_events)
    state.taken_from_preemptor = snap.taken_from_preemptor
    state.attempt_keys_reused = snap.attempt_keys_reused
    state.live_by_rank = snap.live_by_rank
    state.limits = snap.limits
    state.limit_versions = snap.limit_versions
    state.usage.users = snap.usage_users
    state.usage.tokens = snap.usage_tokens
    state.over_limits = snap.over_limits
    state.recent_use = snap.recent_use
    state.compacted_jobs = snap.compacted_jobs
    state.compacted_live = snap.compacted_live
    return state


def write_atomically(path: Path, data: bytes) -> None:
    """Written beside, then renamed into place: a crash never leaves half a snapshot."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
