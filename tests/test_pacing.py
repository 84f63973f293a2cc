"""shared/pacing.py: the one rule for when a batching sender goes next."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from berth.shared.pacing import next_at


@pytest.mark.parametrize(
    ("now", "last", "window", "at"),
    [
        (10.0, None, 0.02, 10.0),  # the first ever: at once
        (10.0, 9.0, 0.02, 10.0),  # after a quiet spell: at once
        (10.0, 9.98, 0.02, 10.0),  # exactly a window after the last: at once
        (10.0, 9.99, 0.02, 10.01),  # 10 ms after the last: the window's rest
        (10.0, 10.0, 0.02, 10.02),  # right after the last: the whole window, never more
        (10.0, 10.0, 0.0, 10.0),  # a window of 0: no pacing
        (10.0, 10.0, -1.0, 10.0),
    ],
)
def test_when_the_next_goes(now: float, last: float | None, window: float, at: float) -> None:
    assert next_at(now, last, window) == pytest.approx(at)


times = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@given(now=times, back=st.floats(min_value=0, max_value=10), window=st.floats(0, 5))
def test_at_once_or_a_whole_window_after_the_last_and_never_later_than_now_plus_a_window(
        now: float, back: float, window: float) -> None:
    last = now - back
    at = next_at(now, last, window)
    assert now <= at <= now + window
    assert at == now or at == pytest.approx(last + window)
