"""When `berth up` restarts a child that exited: exponential backoff with jitter, capped,
and forgotten once the child has stayed up a while. Pure: the caller owns the clock, the
randomness and the processes (berth/stack.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

# Past this many quick exits in a row the delay is at its cap anyway; bounding the exponent
# keeps `factor ** n` from overflowing a float in a child that crash-loops for days.
_MAX_EXPONENT = 64


@dataclass(frozen=True)
class RestartPolicy:
    first_delay: float = 0.5
    factor: float = 2.0
    max_delay: float = 30.0
    # A child up this long had recovered: its next exit starts the backoff afresh.
    stable_after: float = 60.0


@dataclass(frozen=True)
class ChildHistory:
    started_at: float
    restarts: int = 0
    # Exits in a row that came sooner than `stable_after` after their start.
    quick_exits: int = 0


def after_exit(policy: RestartPolicy, history: ChildHistory, exited_at: float,
               jitter: float) -> tuple[ChildHistory, float]:
    """The history with this exit counted, and the seconds to wait before the restart.
    `jitter` in [0, 1] picks the delay within [d/2, d] of the backoff step d, so children
    that died together do not all come back in step; the delay is never below
    first_delay / 2, so a crash loop is never a busy loop."""
    stayed_up = exited_at - history.started_at
    streak = 0 if stayed_up >= policy.stable_after else history.quick_exits
    step = min(policy.max_delay,
               policy.first_delay * policy.factor ** min(streak, _MAX_EXPONENT))
    delay = step / 2 + step / 2 * min(max(jitter, 0.0), 1.0)
    return replace(history, quick_exits=streak + 1), delay


def restarted(history: ChildHistory, now: float) -> ChildHistory:
    """The history of a child just started again."""
    return replace(history, started_at=now, restarts=history.restarts + 1)
