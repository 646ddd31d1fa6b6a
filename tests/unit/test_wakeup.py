"""Wakeup (server/wakeup.py): the controller's "make a pass now", built before whoever asks (issue 42)."""

from __future__ import annotations

import trio
import trio.testing

from llmgw.server.wakeup import Wakeup


async def test_wakes_before_the_wait_count_once_and_a_timeout_leaves_it_ready(
        autojump_clock: trio.testing.MockClock) -> None:
    wakeup = Wakeup()
    wakeup.wake()
    wakeup.wake()  # a level, not a count
    start = trio.current_time()
    with trio.move_on_after(5):
        await wakeup.wait()
    assert trio.current_time() == start and not wakeup.is_set()
    with trio.move_on_after(5) as scope:
        await wakeup.wait()  # the two wakes made one pass: this one waits out its timeout
    assert scope.cancelled_caught and not wakeup.is_set()


async def test_a_wake_from_another_task_ends_the_wait(autojump_clock: trio.testing.MockClock) -> None:
    wakeup = Wakeup()
    async with trio.open_nursery() as nursery:
        async def later() -> None:
            await trio.sleep(1)  # ok: MockClock time (autojump), no wall-clock wait
            wakeup.wake()

        nursery.start_soon(later)
        start = trio.current_time()
        with trio.move_on_after(10):
            await wakeup.wait()
        assert trio.current_time() - start == 1
