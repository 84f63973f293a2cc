"""read_pacing.ReadPacer: a busy connection's small reads are followed by a pause; an idle or
lightly used one's never are, nor is a read that filled the buffer."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from berth.shared.read_pacing import ReadPacer


def feed(pacer: ReadPacer, per_second: float, seconds: float, size: int = 200,
         start: float = 100.0, messages: int = 0) -> tuple[list[float], int, float]:
    """One message per read at `per_second`: the pauses asked for."""
    pauses, now = [], start
    for _ in range(int(per_second * seconds)):
        messages += 1
        pauses.append(pacer.pause_after(size, messages, now))
        now += 1 / per_second
    return pauses, messages, now


@pytest.mark.parametrize("per_second", [1, 100, 500, 900])
def test_a_lightly_used_connection_is_never_paced(per_second: float) -> None:
    pauses, _, _ = feed(ReadPacer(), per_second, 3.0)
    assert set(pauses) == {0.0}


def test_a_busy_connection_is_paced_from_its_second_window_and_stops_once_quiet() -> None:
    pacer = ReadPacer()
    pauses, messages, now = feed(pacer, 10_000, 1.0)
    assert set(pauses[:1000]) == {0.0}  # the first window only counts
    assert set(pauses[2000:]) == {pacer.pause}
    # Quiet again: the next read after a quiet spell is not paused, nor are later ones.
    now += 5.0
    quiet, _, _ = feed(pacer, 10, 2.0, start=now, messages=messages)
    assert set(quiet) == {0.0}


def test_a_read_that_filled_the_buffer_is_not_followed_by_a_pause() -> None:
    pacer = ReadPacer()
    _, messages, now = feed(pacer, 10_000, 0.5)
    assert pacer.paced
    assert pacer.pause_after(pacer.small, messages + 100, now) == 0.0
    assert pacer.pause_after(pacer.small - 1, messages + 101, now) == pacer.pause


@given(st.lists(st.tuples(st.floats(0, 0.05), st.integers(0, 50), st.integers(0, 70_000)),
                max_size=200))
def test_a_pause_is_only_ever_the_pause_and_only_after_a_busy_window(
        steps: list[tuple[float, int, int]]) -> None:
    pacer = ReadPacer()
    now, messages = 0.0, 0
    for gap, arrived, size in steps:
        now += gap
        messages += arrived
        pause = pacer.pause_after(size, messages, now)
        assert pause in (0.0, pacer.pause)
        assert not pause or (pacer.paced and size < pacer.small)
    # Fewer messages in total than one busy window holds: never paced.
    if messages < pacer.busy_messages:
        assert not pacer.paced
