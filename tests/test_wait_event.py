"""shared/service.wait_event: an event wait with a timeout, in the calling task; and
cancel_and_wait, which ends tasks even when one drops a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from berth.shared.service import cancel_and_wait, wait_event, wait_or_stop


async def test_an_event_already_set_returns_at_once() -> None:
    event = asyncio.Event()
    event.set()
    assert await wait_event(event, 10) is True


async def test_an_event_set_while_waiting_wakes_the_wait() -> None:
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, event.set)
    started = loop.time()
    assert await wait_event(event, 10) is True
    assert loop.time() - started < 5


async def test_the_timeout_returns_false_and_leaves_no_task_behind() -> None:
    event = asyncio.Event()
    before = len(asyncio.all_tasks())
    assert await wait_event(event, 0.01) is False
    assert len(asyncio.all_tasks()) == before
    assert not event._waiters  # the cancelled wait let go of the event


async def test_cancelling_the_waiter_is_not_taken_for_a_timeout() -> None:
    stop = asyncio.Event()
    waiting = asyncio.create_task(wait_or_stop(stop, 10))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_a_task_that_drops_a_cancellation_is_cancelled_again() -> None:
    """As Python 3.11's asyncio.wait_for does when a cancellation lands as its wait ends
    (nats-py's requests use it): the task goes on, and a term's end that cancelled it once
    and waited for it waited forever."""
    dropped: list[int] = []

    async def drops_one() -> None:
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if dropped:
                    raise
                dropped.append(1)

    async def fails() -> None:
        raise RuntimeError("read, not reported as never retrieved")

    task, failing = asyncio.create_task(drops_one()), asyncio.create_task(fails())
    await asyncio.sleep(0.02)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=0.1)
    assert not done and dropped  # one cancellation is not enough
    await asyncio.wait_for(cancel_and_wait([task, failing], again_after=0.05), 5)
    assert task.cancelled() and failing.done()
