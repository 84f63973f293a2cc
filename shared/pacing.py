"""When a sender that batches goes next: at once after a quiet spell, at most once per
window while busy. One rule for a worker's attempt reports (BERTH_REPORT_COALESCE) and the
dashboard's live fold; pure, apart from any transport."""

from __future__ import annotations


def next_at(now: float, last: float | None, window: float) -> float:
    """When the next batch goes (or is taken), asked at `now`, the last one at `last` (None:
    none yet): at once when that was `window` or more ago, so a lone item waits for
    nothing; else when the window since it ends, with whatever came by then, so a busy
    sender goes at most once per `window` and an item waits at most `window`. A `window` of
    0 or less: always at once."""
    if window <= 0 or last is None or now - last >= window:
        return now
    return last + window
