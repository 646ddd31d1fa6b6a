"""The reactor waiting in its own set while trio has nothing else to run (llmgw.web.trioidle):
every way a task becomes runnable must still reach it — a socket it waits on, a thread's
result, a deadline, a callback waking it, a cancel."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import pytest
import trio

from llmgw.web.reactor import READ, STOPPED, Reactor
from llmgw.web.trioidle import TrioIdle
from tests.unit.loopback import wait_for

pytestmark = pytest.mark.skipif(not hasattr(__import__("select"), "epoll"), reason="epoll is Linux's")

LIMIT = 200_000  # events a busy socket makes before going quiet: a hang becomes a failure


async def test_the_installed_trio_is_the_one_this_reads() -> None:
    """If a trio upgrade moves what trioidle reads, this fails, rather than the reactor falling
    back to waiting through trio unseen."""
    assert TrioIdle.find() is not None


async def test_not_under_a_mock_clock(autojump_clock: trio.testing.MockClock) -> None:
    """A mock clock's deadlines are not seconds: the reactor waits through trio there, as before."""
    assert TrioIdle.find() is None


def busy_socket(reactor: Reactor, on_event: Callable[[int], None] = lambda n: None) -> list[int]:
    """A socket that is never quiet (each event makes the next) until LIMIT events: the reactor
    always has something of its own to serve, so it naps in its own set all the while."""
    a, b = socket.socketpair()
    for s in (a, b):
        s.setblocking(False)
    count = [0]

    def busy(mask: int) -> None:
        if mask & STOPPED:
            a.close()
            b.close()
            return
        os.read(a.fileno(), 100)
        count[0] += 1
        on_event(count[0])
        if count[0] < LIMIT:
            b.send(b"x")

    reactor.add(a.fileno(), READ, busy)
    b.send(b"x")
    return count


async def test_a_deadline_reaches_a_reactor_napping_with_work_of_its_own() -> None:
    reactor = Reactor()
    async with trio.open_nursery() as nursery:
        await nursery.start(reactor.run)
        count = busy_socket(reactor)
        await wait_for(lambda: reactor.naps > 0, "the reactor napping")
        before = count[0]
        await trio.sleep(0.01)  # ok: the deadline under test (a napping reactor must wake for it)
        assert before < count[0] < LIMIT, "the sleeper woke only once the busy socket went quiet"
        nursery.cancel_scope.cancel()
    assert not reactor.running


async def test_a_cancel_by_its_own_callback_stops_a_napping_reactor() -> None:
    """No other task can run to deliver it: the nap itself must see the cancel."""
    reactor = Reactor()
    scope = trio.CancelScope()
    counts: list[list[int]] = []

    async def run_reactor(task_status: trio.TaskStatus[None]) -> None:
        with scope:  # the reactor's task alone: its cancel reschedules no other
            await reactor.run(task_status=task_status)

    async with trio.open_nursery() as nursery:
        await nursery.start(run_reactor)
        counts.append(busy_socket(reactor, lambda n: scope.cancel() if n == 1000 else None))
    assert counts[0][0] < LIMIT and not reactor.running, counts[0][0]


async def test_a_task_waiting_on_a_socket_and_a_thread_reach_a_napping_reactor() -> None:
    reactor = Reactor()
    ours, theirs = socket.socketpair()
    waiter = trio.socket.from_stdlib_socket(ours)
    got: list[bytes] = []

    async def wait_on_socket() -> None:
        for _ in range(5):
            got.append(await waiter.recv(1))  # woken through trio's set, polled beside ours

    async with trio.open_nursery() as nursery:
        await nursery.start(reactor.run)
        count = busy_socket(reactor)
        await wait_for(lambda: reactor.naps > 0, "the reactor napping")
        with trio.fail_after(10):
            async with trio.open_nursery() as inner:
                inner.start_soon(wait_on_socket)
                for _ in range(5):
                    await trio.to_thread.run_sync(theirs.send, b"y")  # a thread's result: trio's wakeup
        assert got == [b"y"] * 5
        assert count[0] < LIMIT, "the tasks ran only once the busy socket went quiet"
        nursery.cancel_scope.cancel()
    waiter.close()
    theirs.close()


async def test_a_task_a_callback_wakes_runs_while_the_reactor_has_work_of_its_own() -> None:
    reactor = Reactor()
    send, receive = trio.open_memory_channel[int](10)
    async with trio.open_nursery() as nursery:
        await nursery.start(reactor.run)
        count = busy_socket(reactor, lambda n: send.send_nowait(n) if n == 1000 else None)
        with trio.fail_after(10):
            assert await receive.receive() == 1000
        assert count[0] < LIMIT and reactor.naps > 0
        nursery.cancel_scope.cancel()


async def test_served_while_napping_without_a_pass_of_trio_each() -> None:
    """The point of it: an exchange at a time (the test's task blocked on a thread) is served
    from the nap, not by a trip through trio's scheduler for each."""
    reactor = Reactor()
    a, b = socket.socketpair()
    a.setblocking(False)

    def echo(mask: int) -> None:
        if not mask & STOPPED:
            os.write(a.fileno(), os.read(a.fileno(), 100))

    def exchanges() -> None:
        for _ in range(50):
            b.sendall(b"ping")
            assert b.recv(100) == b"ping"

    async with trio.open_nursery() as nursery:
        await nursery.start(reactor.run)
        reactor.add(a.fileno(), READ, echo)
        passes = reactor.passes
        with trio.fail_after(10):
            await trio.to_thread.run_sync(exchanges)
        assert reactor.naps >= 40 and reactor.passes - passes < 25, (reactor.naps, reactor.passes - passes)
        nursery.cancel_scope.cancel()
    a.close()
    b.close()
