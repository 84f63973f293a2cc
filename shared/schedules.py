"""The pure rules of schedules (docs/lifecycle.md, "Schedules"): whether a cron expression
and time zone are usable, when a schedule next fires, and which fire a leader starts now.
Cron arithmetic is croniter's; time zones are zoneinfo's (the IANA database)."""

from __future__ import annotations

import math
import zoneinfo
from datetime import datetime

from croniter import CroniterError, croniter


def _zone(timezone: str) -> zoneinfo.ZoneInfo:
    try:
        return zoneinfo.ZoneInfo(timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"schedule.timezone: unknown time zone {timezone!r} (an IANA name "
                         "such as UTC or Europe/Paris)") from None


def check(cron: str, timezone: str) -> None:
    """Raises ValueError, one line naming the field, for a schedule that cannot fire."""
    _zone(timezone)
    if not croniter.is_valid(cron):
        raise ValueError(f"schedule.cron: {cron!r} is not a cron expression (5 fields: "
                         "minute hour day month weekday, or 6 with seconds last)")
    try:
        next_fire(cron, timezone, 0.0)
    except (CroniterError, ValueError) as exc:
        raise ValueError(f"schedule.cron: {cron!r} never fires ({exc})") from None


def _iter(cron: str, timezone: str, start: float) -> croniter:
    return croniter(cron, datetime.fromtimestamp(start, _zone(timezone)))


def next_fire(cron: str, timezone: str, after: float) -> float:
    """The first fire time strictly after `after` (epoch seconds)."""
    return float(_iter(cron, timezone, after).get_next(float))


def due_fire(cron: str, timezone: str, since: float, now: float) -> float | None:
    """The fire a leader starts at `now`, if any: the latest fire time in (since, now],
    where `since` is the last fire time started (or the schedule's creation). Several
    missed while no scheduler led are started once, as that latest one (catch-up)."""
    if next_fire(cron, timezone, since) > now:
        return None
    # Cron's resolution is a whole second: the latest fire at or before floor(now).
    return float(_iter(cron, timezone, math.floor(now) + 1).get_prev(float))
