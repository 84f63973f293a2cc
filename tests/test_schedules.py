"""Schedules as pure rules (shared/schedules.py): the next fire, and which fire a leader
starts (the latest due one, once); and the fold's record of a schedule's fires."""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter
from hypothesis import given, settings
from hypothesis import strategies as st

from berth.services.scheduler.schedule_fires import due
from berth.shared import schedules, state_snapshot
from berth.shared.lifecycle import ClusterState
from berth.shared.messages import (
    JobCancelRequested,
    JobSpec,
    JobSubmitted,
    ScheduleCreated,
    ScheduleSpec,
)


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


DAY3 = "0 3 * * *"
# (cron, zone, since, now) -> the fire to start now
DUE = [
    (DAY3, "UTC", "2026-01-01 00:00", "2026-01-01 02:59:59", None),
    (DAY3, "UTC", "2026-01-01 00:00", "2026-01-01 03:00", "2026-01-01 03:00"),
    # Three nights missed while no scheduler led: only the last is started.
    (DAY3, "UTC", "2026-01-01 03:00", "2026-01-04 12:00", "2026-01-04 03:00"),
    # Already fired at 03:00: nothing more that day.
    (DAY3, "UTC", "2026-01-04 03:00", "2026-01-04 23:59", None),
    # 03:00 in Paris is 02:00 UTC in winter, 01:00 UTC in summer.
    (DAY3, "Europe/Paris", "2026-01-01 00:00", "2026-01-01 02:00", "2026-01-01 02:00"),
    (DAY3, "Europe/Paris", "2026-07-01 00:00", "2026-07-01 01:30", "2026-07-01 01:00"),
    # Seconds, the 6th field: every 5 s.
    ("* * * * * */5", "UTC", "2026-01-01 00:00:05", "2026-01-01 00:00:09.9", None),
    ("* * * * * */5", "UTC", "2026-01-01 00:00:05", "2026-01-01 00:00:31", "2026-01-01 00:00:30"),
]


@pytest.mark.parametrize(("cron", "zone", "since", "now", "fire"), DUE)
def test_due_fire_table(cron: str, zone: str, since: str, now: str, fire: str | None) -> None:
    got = schedules.due_fire(cron, zone, at(since), at(now))
    assert got == (None if fire is None else at(fire))


def test_next_fire() -> None:
    assert schedules.next_fire(DAY3, "UTC", at("2026-01-01 03:00")) == at("2026-01-02 03:00")
    assert schedules.next_fire(DAY3, "UTC", at("2026-01-01 02:59:59.5")) == at(
        "2026-01-01 03:00")


CRONS = ["* * * * *", "*/7 * * * *", "0 3 * * *", "* * * * * */3", "15 */2 * * 1-5"]


@settings(max_examples=40)
@given(st.sampled_from(CRONS), st.sampled_from(["UTC", "Asia/Kolkata", "America/New_York"]),
       st.floats(1.7e9, 1.8e9), st.floats(0, 5 * 86400))
def test_due_fire_is_the_latest_cron_time_in_the_window(
        cron: str, zone: str, since: float, span: float) -> None:
    now = since + span
    got = schedules.due_fire(cron, zone, since, now)
    first = schedules.next_fire(cron, zone, since)
    if got is None:
        assert first > now  # nothing was due
        return
    assert since < got <= now
    assert croniter.match(cron, datetime.fromtimestamp(got, ZoneInfo(zone)))
    assert schedules.next_fire(cron, zone, got) > now  # none later is due: started once


def schedule_spec() -> JobSpec:
    return JobSpec(name="nightly", command=["true"], user="ada",
                   schedule=ScheduleSpec(cron=DAY3))


def test_the_fold_records_fires_and_a_cancel_stops_them() -> None:
    state = ClusterState()
    created = at("2026-01-01 00:00")
    state.apply(1, ScheduleCreated(schedule_id="s1-aaaa", submit_seq=1, spec=schedule_spec(),
                                   ts=created))
    schedule = state.schedules["s1-aaaa"]
    assert due(schedule, at("2026-01-01 02:00")) is None
    night = at("2026-01-01 03:00")
    assert due(schedule, at("2026-01-01 04:00")) == night
    job = JobSpec(name="nightly", command=["true"], user="ada")
    state.apply(2, JobSubmitted(job_id="j2-bbbb", submit_seq=2, spec=job, schedule_id="s1-aaaa",
                                fire_at=night, ts=night + 1))
    assert (schedule.fired, schedule.last_job, schedule.last_fire_at) == (1, "j2-bbbb", night)
    assert due(schedule, at("2026-01-01 04:00")) is None  # that fire is made
    assert due(schedule, at("2026-01-05 04:00")) == at("2026-01-05 03:00")
    again = state_snapshot.load(state_snapshot.dump(state, "s"), "s", 2)
    assert again.schedules == state.schedules
    state.apply(3, JobCancelRequested(job_id="s1-aaaa", submit_seq=3, ts=night + 2))
    assert schedule.cancelled_at == night + 2 and due(schedule, at("2026-01-05 04:00")) is None
    assert "j2-bbbb" in state.jobs and state.jobs["j2-bbbb"].error == ""  # its job runs on
