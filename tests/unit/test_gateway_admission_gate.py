"""Admission trio wrapper under trio's MockClock (virtual time, autojump)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from llmgw.server.gateway.admission_gate import AdmissionGate, AdmissionRejected


async def hold(
    gate: AdmissionGate, seconds: float, log: list[tuple[str, float]], name: str
) -> None:
    async with gate.admit():
        log.append((name, trio.current_time()))
        await trio.sleep(seconds)


async def test_admitted_at_once_under_the_limit(autojump_clock: trio.testing.MockClock) -> None:
    waits: list[float] = []
    gate = AdmissionGate(limit=2, max_queue=1, max_wait=10, on_admit=waits.append)
    start = trio.current_time()
    async with gate.admit(), gate.admit():
        assert trio.current_time() == start
        assert gate.in_flight == 2
    assert gate.in_flight == 0 and gate.admitted_total == 2 and waits == [0.0, 0.0]


async def test_queued_request_is_admitted_the_moment_a_slot_frees(
    autojump_clock: trio.testing.MockClock,
) -> None:
    waits: list[float] = []
    gate = AdmissionGate(limit=1, max_queue=4, max_wait=60, on_admit=waits.append)
    log: list[tuple[str, float]] = []
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, gate, 5.0, log, "first")
        await trio.sleep(1)  # ok: virtual time (autojump_clock)
        nursery.start_soon(hold, gate, 2.0, log, "second")
        await trio.sleep(0.5)  # ok: virtual time (autojump_clock) ; trio may run tasks started together in any order
        nursery.start_soon(hold, gate, 1.0, log, "third")
        await trio.sleep(1)  # ok: virtual time (autojump_clock)
        assert gate.queued == 2 and gate.in_flight == 1
    # admitted exactly at the release time, in arrival order: no polling tick in between
    assert log == [("first", t0), ("second", t0 + 5.0), ("third", t0 + 7.0)]
    assert waits == [0.0, 4.0, 5.5]
    assert gate.in_flight == 0 and gate.queued == 0


async def test_expired_wait_is_rejected_with_retry_after(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rejects: list[str] = []
    gate = AdmissionGate(limit=1, max_queue=4, max_wait=3, on_reject=rejects.append)
    log: list[tuple[str, float]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, gate, 100.0, log, "hog")
        await trio.sleep(1)  # ok: virtual time (autojump_clock)
        t = trio.current_time()
        with pytest.raises(AdmissionRejected) as info:
            async with gate.admit():
                pytest.fail("must not be admitted")
        assert trio.current_time() == t + 3.0
        assert info.value.reason == "queue wait expired" and info.value.retry_after >= 1
        assert gate.queued == 0 and gate.in_flight == 1
        nursery.cancel_scope.cancel()
    assert rejects == ["queue wait expired"] and gate.rejected_total == {"queue wait expired": 1}
    assert gate.in_flight == 0


async def test_full_queue_is_rejected_at_once(autojump_clock: trio.testing.MockClock) -> None:
    gate = AdmissionGate(limit=1, max_queue=1, max_wait=30)
    log: list[tuple[str, float]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, gate, 10.0, log, "a")
        await trio.sleep(0.1)  # ok: virtual time (autojump_clock)
        nursery.start_soon(hold, gate, 1.0, log, "b")
        await trio.sleep(0.4)  # ok: virtual time (autojump_clock)
        t = trio.current_time()
        with pytest.raises(AdmissionRejected) as info:
            async with gate.admit():
                pass
        assert trio.current_time() == t
        assert info.value.reason == "queue full" and info.value.retry_after >= 1
        assert "retry after" in str(info.value)
    assert [name for name, _ in log] == ["a", "b"]


async def test_cancelled_waiter_leaves_the_queue_and_leaks_no_slot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = AdmissionGate(limit=1, max_queue=4, max_wait=60)
    log: list[tuple[str, float]] = []
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, gate, 5.0, log, "first")
        await trio.sleep(1)  # ok: virtual time (autojump_clock)
        with trio.move_on_after(2):  # the client goes away after 2 s in the queue
            async with gate.admit():
                pytest.fail("must not be admitted")
        assert gate.queued == 0
        nursery.start_soon(hold, gate, 1.0, log, "next")
    assert log == [("first", t0), ("next", t0 + 5.0)]
    assert gate.in_flight == 0 and gate.queued == 0
    async with gate.admit():  # the slot is really free
        assert trio.current_time() == t0 + 6.0


@pytest.mark.parametrize("cancel_first", [True, False])
async def test_waiter_cancelled_in_the_instant_it_gets_the_slot(
    autojump_clock: trio.testing.MockClock, cancel_first: bool
) -> None:
    """The slot reaches a waiter whose client goes away in the same instant (its cancellation
    lands just before or just after the release woke it): the slot goes on to the next waiter
    at once, never lost."""
    gate = AdmissionGate(limit=1, max_queue=4, max_wait=60)
    log: list[tuple[str, float]] = []
    finished_states: list[str] = []
    real = gate.core

    class Spy:
        """The core, with each finish() recorded (a compiled Admission's methods cannot be
        replaced; the gate, not compiled, takes any object that answers as the core does)."""

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def finish(self, ticket, now):  # type: ignore[no-untyped-def]
            finished_states.append(ticket.state.value)
            return real.finish(ticket, now)

    gate.core = Spy()  # type: ignore[assignment]
    t0 = trio.current_time()
    doomed = trio.CancelScope()

    async def first() -> None:
        async with gate.admit():
            await trio.sleep(5)  # ok: virtual time (autojump_clock)
            if cancel_first:
                doomed.cancel()  # the waiter's wait is cancelled, then the slot reaches it
        if not cancel_first:
            doomed.cancel()  # the slot reached the waiter, then its client goes away

    async def doomed_waiter() -> None:
        with doomed:
            async with gate.admit():
                log.append(("doomed", trio.current_time()))
                await trio.sleep(1)  # ok: virtual time (autojump_clock)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first)
        await trio.sleep(1)  # ok: virtual time (autojump_clock)
        nursery.start_soon(doomed_waiter)
        await trio.sleep(1)  # ok: virtual time (autojump_clock)
        nursery.start_soon(hold, gate, 1.0, log, "third")
    assert ("third", t0 + 5.0) in log
    assert (("doomed", t0 + 5.0) in log) is not cancel_first
    # every ticket handed back once; the doomed one while it held the slot it never used
    assert finished_states.count("admitted") == 3
    assert gate.in_flight == 0 and gate.queued == 0


async def test_raising_the_limit_wakes_waiters(autojump_clock: trio.testing.MockClock) -> None:
    gate = AdmissionGate(limit=1, max_queue=4, max_wait=60)
    log: list[tuple[str, float]] = []
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, gate, 10.0, log, "a")
        await trio.sleep(1)  # ok: virtual time (autojump_clock)
        nursery.start_soon(hold, gate, 1.0, log, "b")
        await trio.sleep(1)  # ok: virtual time (autojump_clock)
        gate.set_limits(limit=2, max_queue=4, max_wait=60)
    assert log == [("a", t0), ("b", t0 + 2.0)]


async def test_many_waiters_with_random_cancellations_leak_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    import random

    rng = random.Random(5)
    gate = AdmissionGate(limit=3, max_queue=10, max_wait=2)
    outcomes: list[str] = []

    async def client(patience: float, service: float) -> None:
        with trio.move_on_after(patience):
            try:
                async with gate.admit():
                    assert gate.in_flight <= 3
                    await trio.sleep(service)
                    outcomes.append("done")
                    return
            except AdmissionRejected as exc:
                outcomes.append(exc.reason)
                return
        outcomes.append("cancelled")

    async with trio.open_nursery() as nursery:
        for _ in range(200):
            nursery.start_soon(client, rng.uniform(0.1, 10), rng.uniform(0.1, 3))
            await trio.sleep(rng.uniform(0, 0.3))
    assert len(outcomes) == 200
    assert set(outcomes) == {"done", "cancelled", "queue wait expired", "queue full"}
    assert gate.in_flight == 0 and gate.queued == 0 and gate.core._queue == {}


async def test_admit_now_never_overtakes_a_waiter_and_release_passes_the_slot_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The gateway's way in (admit_now, else acquire; then release): a newcomer takes a free slot
    at once, but not while someone waits for one, and its release admits the waiter."""
    waits: list[float] = []
    gate = AdmissionGate(limit=1, max_queue=4, max_wait=60, on_admit=waits.append)
    t0 = trio.current_time()
    first = gate.admit_now(t0)
    assert first is not None and gate.in_flight == 1
    assert gate.admit_now(trio.current_time()) is None  # no slot
    admitted_at: list[float] = []

    async def waiter() -> None:
        ticket = await gate.acquire()
        admitted_at.append(trio.current_time())
        gate.release(ticket)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert gate.queued == 1
        await trio.sleep(3)  # ok: virtual time (autojump_clock)
        gate.release(first)  # the slot goes to the waiter, not to the next newcomer
        assert gate.admit_now(trio.current_time()) is None
    assert admitted_at == [pytest.approx(t0 + 3.0)] and gate.in_flight == 0
    assert waits == [0.0, pytest.approx(3.0)] and gate.admitted_total == 2
