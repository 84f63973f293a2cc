"""The host timeline (docs/dashboard.md, "Host timeline"): which attempt held which host
when, and how busy the cluster was. Pure functions over the folded state and the
projection's per-host index; the JSON shapes `GET /api/timeline` returns.

Bounded for a large cluster: a request reads one page of hosts (at most MAX_HOSTS), each
host's index keeps its newest HOST_HISTORY attempts (plus whatever still holds it, however
old), and a host shows at most MAX_BARS bars; anything cut says so (`truncated`)."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import msgspec

from berth.shared.lifecycle import AttemptView, ClusterState, JobView, WorkerView
from berth.shared.states import TaskState

HOST_HISTORY = 500  # attempts per host the index keeps (the newest)
MAX_HOSTS = 500  # hosts per page
MAX_BARS = 200  # bars per host in one answer (the newest)
MAX_POINTS = 300  # points of the cluster chart in one answer
CLUSTER_HISTORY = 20_000  # cluster samples kept (at most one per second of event time)
SAMPLE_EVERY = 1.0  # seconds of folding between two cluster samples


class HostAttempt(NamedTuple):
    """One attempt in a host's index: the AttemptView itself, which the fold updates in
    place, so the index never goes stale."""

    job_id: str
    task_index: int
    attempt: AttemptView
    exclusive: bool  # a gang attempt whose group no other gang may share


class Bar(msgspec.Struct):
    job_id: str
    task_index: int
    attempt_id: int
    group: str  # its gang's coscheduling group, "" for a task of no gang
    exclusive: bool  # the group is held exclusively (not `coscheduling.shareable`)
    start: float  # assigned: the host's resources are reserved from here
    started: float | None  # running from here
    end: float | None  # its process is known gone (resources freed); null: still holds
    state: str


class HostRow(msgspec.Struct):
    worker_id: str
    host: str
    alive: bool
    bars: list[Bar]
    # Pairs of attempts of different gangs that held this host at once: must stay empty
    # (docs/invariants.md, invariant 2); the page marks such a row.
    overlaps: list[str]
    truncated: bool  # more than MAX_BARS attempts in the window: the oldest are left out


class ClusterPoint(msgspec.Struct):
    """Tasks by state and hosts holding at least one attempt, as of event time `ts`."""

    ts: float
    pending: int
    assigned: int
    running: int
    hosts_busy: int
    hosts_up: int


class Timeline(msgspec.Struct):
    since: float
    until: float
    hosts: list[HostRow]
    total_hosts: int  # hosts matching the request, over all pages
    next_cursor: str | None  # pass as `cursor` for the next page of hosts
    truncated: bool  # some host left bars out
    cluster: list[ClusterPoint]


# --- the per-host index ---------------------------------------------------------------------


def exclusive_group(job: JobView, attempt: AttemptView) -> bool:
    cosched = job.spec.coscheduling
    return bool(attempt.group) and not (cosched and cosched.shareable)


def index_attempt(index: dict[str, deque[HostAttempt]], job: JobView, task_index: int,
                  attempt: AttemptView) -> None:
    entries = index.setdefault(attempt.worker_id, deque(maxlen=HOST_HISTORY))
    entries.append(HostAttempt(job.job_id, task_index, attempt, exclusive_group(job, attempt)))


def build_index(state: ClusterState) -> dict[str, deque[HostAttempt]]:
    """The index of a whole state (a loaded snapshot), each host's attempts by assignment."""
    found: dict[str, list[HostAttempt]] = {}
    for job in state.jobs.values():
        shareable = bool(job.spec.coscheduling and job.spec.coscheduling.shareable)
        for task in job.tasks:
            for a in task.attempts:
                found.setdefault(a.worker_id, []).append(
                    HostAttempt(job.job_id, task.index, a, bool(a.group) and not shareable))
    return {worker: deque(sorted(entries, key=_assigned), maxlen=HOST_HISTORY)
            for worker, entries in found.items()}


def _assigned(entry: HostAttempt) -> tuple[float, str, int, int]:
    return (entry.attempt.assigned_at, entry.job_id, entry.task_index,
            entry.attempt.attempt_id)


# --- one host's row -----------------------------------------------------------------------


def end_of(a: AttemptView) -> float | None:
    return a.finished_at if a.exited else None


def in_window(a: AttemptView, since: float, until: float) -> bool:
    end = end_of(a)
    return a.assigned_at < until and (end is None or end > since)


def bar(entry: HostAttempt) -> Bar:
    a = entry.attempt
    return Bar(job_id=entry.job_id, task_index=entry.task_index, attempt_id=a.attempt_id,
               group=a.group, exclusive=entry.exclusive, start=a.assigned_at,
               started=a.started_at, end=end_of(a), state=a.state.display)


def overlaps(bars: Sequence[Bar]) -> list[str]:
    """Attempts of two different gangs holding the host at once, one of them exclusively:
    what reserve.lua refuses. Tasks of no gang may share a host within its capacity."""
    gangs = sorted((b for b in bars if b.group), key=lambda b: b.start)
    found: list[str] = []
    for i, a in enumerate(gangs):
        for b in gangs[i + 1:]:
            if a.end is not None and b.start >= a.end:
                continue
            if a.job_id != b.job_id and (a.exclusive or b.exclusive):
                found.append(f"{a.job_id}/{a.task_index}#{a.attempt_id} and "
                             f"{b.job_id}/{b.task_index}#{b.attempt_id}")
    return found


def host_row(state: ClusterState, worker: WorkerView, entries: Iterable[HostAttempt],
             since: float, until: float) -> HostRow:
    chosen: dict[tuple[str, int, int], HostAttempt] = {}
    for entry in entries:
        if in_window(entry.attempt, since, until):
            chosen[(entry.job_id, entry.task_index, entry.attempt.attempt_id)] = entry
    # An attempt still holding the host counts however far back the index reaches.
    for job_id, task_index, attempt_id in worker.live_attempts.values():
        key = (job_id, task_index, attempt_id)
        task = state.task(job_id, task_index)
        attempt = task.attempt(attempt_id) if task else None
        if key not in chosen and attempt is not None and in_window(attempt, since, until):
            chosen[key] = HostAttempt(job_id, task_index, attempt,
                                      exclusive_group(state.jobs[job_id], attempt))
    ordered = sorted(chosen.values(), key=_assigned)
    bars = [bar(e) for e in ordered[-MAX_BARS:]]
    return HostRow(worker_id=worker.worker_id, host=worker.host, alive=worker.alive,
                   bars=bars, overlaps=overlaps(bars), truncated=len(ordered) > MAX_BARS)


def host_page(state: ClusterState, index: dict[str, deque[HostAttempt]], since: float,
              until: float, wanted: Sequence[str] | None, limit: int,
              cursor: str | None) -> tuple[list[HostRow], int, str | None]:
    """One page of host rows (by worker id), the hosts matching, and the next cursor."""
    names = sorted(state.workers if wanted is None
                   else {w for w in wanted if w in state.workers})
    start = 0 if cursor is None else bisect.bisect_right(names, cursor)
    page = names[start:start + limit]
    rows = [host_row(state, state.workers[w], index.get(w, ()), since, until) for w in page]
    more = start + limit < len(names)
    return rows, len(names), page[-1] if more and page else None


# --- the cluster chart ------------------------------------------------------------------------


def cluster_point(state: ClusterState, ts: float) -> ClusterPoint:
    assigned = running = busy = up = 0
    for worker in state.workers.values():
        up += worker.alive
        busy += bool(worker.live_attempts)
        for job_id, task_index, attempt_id in worker.live_attempts.values():
            task = state.task(job_id, task_index)
            attempt = task.attempt(attempt_id) if task else None
            if attempt is None:
                continue
            if attempt.state == TaskState.RUNNING:
                running += 1
            else:
                assigned += 1  # assigned, building, or being killed: holding the host
    return ClusterPoint(ts, len(state.pending), assigned, running, busy, up)


def record_point(samples: deque[ClusterPoint], point: ClusterPoint) -> None:
    """At most one sample per second of event time: a newer one within the same second
    replaces the last, so the newest always shows the state as it stands."""
    if samples and int(point.ts) <= int(samples[-1].ts):
        samples[-1] = point
        return
    samples.append(point)


def cluster_series(samples: Iterable[ClusterPoint], since: float, until: float,
                   now: ClusterPoint | None = None,
                   points: int = MAX_POINTS) -> list[ClusterPoint]:
    """The samples within the window, thinned to at most `points` (the last of each equal
    slice of time), led by the one in force when the window opens, and ended by `now`
    (the state as it stands) when it is newer than them."""
    kept = list(samples)
    if now is not None and (not kept or now.ts >= kept[-1].ts):
        if kept and int(now.ts) <= int(kept[-1].ts):
            kept[-1] = now
        else:
            kept.append(now)
    times = [p.ts for p in kept]
    first = max(bisect.bisect_right(times, since) - 1, 0)
    last = bisect.bisect_right(times, until)
    return list(_thinned(kept[first:last], since, until, points))


def _thinned(window: Sequence[ClusterPoint], since: float, until: float,
             points: int) -> Iterator[ClusterPoint]:
    if len(window) <= points:
        yield from window
        return
    width = (until - since) / points
    slot: ClusterPoint | None = None
    slot_no = -1
    for p in window:
        no = int((p.ts - since) // width) if p.ts > since else -1
        if slot is not None and no != slot_no:
            yield slot
        slot, slot_no = p, no
    if slot is not None:
        yield slot
