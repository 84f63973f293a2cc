"""What a worker's heartbeat tells the leader to re-send (a pure function over the fold),
and how often the leader asks the workers to heartbeat."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

from berth.shared.lifecycle import ClusterState, WorkerView
from berth.shared.messages import Heartbeat, parse_attempt_key
from berth.shared.states import TaskState

AttemptRef = tuple[str, int, int]  # job id, task index, attempt id

# The paced interval moves in steps this long, so one worker joining or leaving seldom
# changes it (each change is a broadcast, and every worker's next answer carries it).
PACE_STEP = 0.5


def pace(live_workers: int, interval: float, rate: float, longest: float) -> float:
    """The heartbeat interval the leader asks of every worker: `interval` (the configured
    one), or longer when that many workers at it would send more than `rate` heartbeats a
    second (each costs the leader and the dashboard alike), rounded up to PACE_STEP; never
    above `longest` (Settings.longest_heartbeat_interval) unless `interval` is. Rate 0:
    `interval`."""
    if not rate > 0 or live_workers <= 0:
        return interval
    wanted = math.ceil(live_workers / rate / PACE_STEP) * PACE_STEP
    return max(interval, min(wanted, longest))


@dataclass
class Verdict:
    # Running on the worker but not a live attempt here (or one being killed): kill it.
    strays: list[AttemptRef] = field(default_factory=list)
    # Assigned, killed before it started, never confirmed: send the kill again.
    unconfirmed_kills: list[AttemptRef] = field(default_factory=list)
    # Assigned long ago and unknown to the worker: the run command was lost; send it again.
    lost_runs: list[AttemptRef] = field(default_factory=list)


def judge(state: ClusterState, worker: WorkerView, hb: Heartbeat, now: float,
          grace: float) -> Verdict:
    """Compares the attempts a heartbeat lists with the fold's live attempts on that worker.
    An attempt leaves the list only once its exit is reported (Heartbeat.reported_seq), so
    one missing from it is judged only once the fold has reached that report: before, it
    may simply have finished. Runs for every heartbeat of every host, so a live attempt's
    key is not parsed again (the fold keeps it parsed)."""
    verdict = Verdict()
    live_attempts = worker.live_attempts
    running = set(hb.attempts)
    listed_live = 0
    for key in running:
        ref = live_attempts.get(key)
        if ref is None:
            with contextlib.suppress(ValueError):  # no key berth makes: no kill names it
                verdict.strays.append(parse_attempt_key(key))
            continue
        listed_live += 1
        job_id, index, attempt_id = ref
        task = state.task(job_id, index)
        live = task.attempt(attempt_id) if task is not None else None
        if live is None or live.kill_requested:
            verdict.strays.append(ref)
    if hb.reported_seq > state.last_seq or listed_live == len(live_attempts):
        return verdict  # the fold lags the worker's reports, or every live attempt is listed
    for key, (job_id, index, attempt_id) in live_attempts.items():
        if key in running or not hb.covers(key):
            continue  # listed, or in another window of a long list
        task = state.task(job_id, index)
        attempt = task.attempt(attempt_id) if task else None
        if attempt is None or attempt.state != TaskState.ASSIGNED:
            continue  # started and since exited: its report is on its way
        if now - attempt.assigned_at <= grace:
            continue  # the run command may still be on its way
        if attempt.kill_requested:
            verdict.unconfirmed_kills.append((job_id, index, attempt_id))
        else:
            verdict.lost_runs.append((job_id, index, attempt_id))
    return verdict
