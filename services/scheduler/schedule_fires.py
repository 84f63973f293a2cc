"""The leader's half of schedules (docs/lifecycle.md, "Schedules"): each due fire becomes
one ScheduleFire on the submit stream, which the submitter turns into the fire's job.

Once per (schedule, fire time), even across fail-overs: the fire is published on the
schedule's own subject only if the last message there is the one this leader read
(JetStream's Nats-Expected-Last-Subject-Sequence), and only for a fire time after the last
one there. Two leaders (an old one that has not noticed it lost, and a new one) that race
for the same fire cannot both win; a fire already made is never made again, whatever the
fold has caught up on. The lease decides only who tries."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
import nats.js.errors
from nats.js import JetStreamContext

from berth.shared import schedules, subjects
from berth.shared.lifecycle import ClusterState, ScheduleView
from berth.shared.messages import ScheduleFire, decode, encode, fire_decoder

log = logging.getLogger("berth.scheduler")

# How often the leader looks for due fires: cron's resolution is a second.
INTERVAL = 0.5
# JetStream's error code for a failed Nats-Expected-Last-Subject-Sequence check.
WRONG_LAST_SEQUENCE = 10071


def due(schedule: ScheduleView, now: float) -> float | None:
    """The fire time to start now for `schedule`, or None (shared/schedules.due_fire)."""
    if schedule.cancelled_at:
        return None
    spec = schedule.spec.schedule
    if spec is None:
        return None
    since = max(schedule.created_at, schedule.last_fire_at)
    return schedules.due_fire(spec.cron, spec.timezone, since, now)


async def fire(js: JetStreamContext, schedule_id: str, at: float) -> bool:
    """Publishes the fire of `schedule_id` at `at` unless it (or a later one) is made
    already, or another leader publishes one first. True if this call made it."""
    subject = subjects.schedule_fire(schedule_id)
    last_seq = 0
    try:
        last = await js.get_last_msg(subjects.SUBMIT_STREAM, subject)
    except nats.js.errors.NotFoundError:
        pass
    else:
        last_seq = last.seq or 0
        try:
            if decode(fire_decoder, last.data or b"").at >= at:
                return False  # made already; the fold has not yet seen its job
        except msgspec.DecodeError:
            pass  # not a fire we wrote: ours goes after it all the same
    try:
        await js.publish(
            subject, encode(ScheduleFire(schedule_id=schedule_id, at=at)),
            stream=subjects.SUBMIT_STREAM,
            headers={"Nats-Msg-Id": f"fire:{schedule_id}:{at:.3f}",
                     "Nats-Expected-Last-Subject-Sequence": str(last_seq)})
    except nats.js.errors.APIError as exc:
        if exc.err_code == WRONG_LAST_SEQUENCE:
            return False  # another leader made a fire in between
        raise
    return True


async def run(js: JetStreamContext, state: ClusterState,
              still_leading: Callable[[], None]) -> None:
    """Fires due schedules for as long as this process leads; `still_leading` raises once
    it may not (the same check every leader action makes first)."""
    while True:
        now = time.time()
        for schedule in list(state.schedules.values()):
            at = due(schedule, now)
            if at is None:
                continue
            still_leading()
            if await fire(js, schedule.schedule_id, at):
                log.info("schedule %s fired for %s", schedule.schedule_id,
                         time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)))
        await asyncio.sleep(INTERVAL)
