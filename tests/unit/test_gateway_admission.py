"""Admission core (pure): limit, FIFO queue, expiry, Retry-After, with a fake clock."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.server.gateway.admission import Admission, Ticket, TicketState

A = TicketState.ADMITTED
Q = TicketState.QUEUED


def test_below_the_limit_is_admitted_at_once() -> None:
    adm = Admission(limit=2, max_queue=4, max_wait=10)
    t1, t2 = adm.arrive(0.0), adm.arrive(0.0)
    assert t1.state is A and t2.state is A and t1.waited == 0.0
    assert adm.in_flight == 2 and adm.queued == 0


def test_unlimited() -> None:
    adm = Admission(limit=0, max_queue=0, max_wait=0)
    tickets = [adm.arrive(0.0) for _ in range(1000)]
    assert all(t.state is A for t in tickets) and adm.in_flight == 1000
    for t in tickets:
        assert adm.finish(t, 1.0) == []
    assert adm.in_flight == 0


def test_queue_is_fifo_and_a_freed_slot_goes_to_the_head() -> None:
    adm = Admission(limit=1, max_queue=10, max_wait=100)
    running = adm.arrive(0.0)
    waiters = [adm.arrive(float(i)) for i in range(1, 6)]
    assert all(w.state is Q for w in waiters) and adm.queued == 5
    order = []
    now = 10.0
    while running is not None:
        woken = adm.finish(running, now)
        assert adm.in_flight == (1 if woken else 0)  # the slot is handed over, never free
        assert len(woken) <= 1
        running = woken[0] if woken else None
        if running is not None:
            assert running.state is A and running.admitted_at == now
            order.append(running)
            # a newcomer while others wait goes behind them, not into the slot
            late = adm.arrive(now)
            assert late.state is Q
            adm.finish(late, now)  # (and leaves again)
        now += 1
    assert order == waiters
    assert [w.waited for w in order] == [9.0, 9.0, 9.0, 9.0, 9.0]


def test_full_queue_is_rejected_with_retry_after() -> None:
    adm = Admission(limit=1, max_queue=2, max_wait=10)
    adm.arrive(0.0)
    adm.arrive(0.0)
    adm.arrive(0.0)
    rejected = adm.arrive(0.0)
    assert rejected.state is TicketState.REJECTED and rejected.reason == "queue full"
    assert rejected.retry_after >= 1
    assert adm.queued == 2 and adm.finish(rejected, 0.0) == []


def test_no_queue_rejects_over_the_limit() -> None:
    for max_queue, max_wait in ((0, 10.0), (5, 0.0)):
        adm = Admission(limit=1, max_queue=max_queue, max_wait=max_wait)
        assert adm.arrive(0.0).state is A
        t = adm.arrive(0.0)
        assert t.state is TicketState.REJECTED and t.reason == "over limit"


def test_expiry() -> None:
    adm = Admission(limit=1, max_queue=10, max_wait=5)
    running = adm.arrive(0.0)
    early, late = adm.arrive(1.0), adm.arrive(3.0)
    assert early.deadline == 6.0 and late.deadline == 8.0
    assert adm.expire(5.999) == []
    assert adm.expire(6.0) == [early]
    assert early.state is TicketState.EXPIRED and early.reason == "queue wait expired"
    assert early.retry_after >= 1 and adm.queued == 1
    # a slot freed after a waiter's deadline skips it
    assert adm.finish(running, 9.0) == []
    assert late.state is TicketState.EXPIRED and adm.in_flight == 0
    assert adm.finish(late, 9.0) == [] and adm.finish(early, 9.0) == []


def test_expired_waiters_do_not_hold_queue_places() -> None:
    adm = Admission(limit=1, max_queue=1, max_wait=5)
    adm.arrive(0.0)
    stale = adm.arrive(0.0)
    assert adm.arrive(4.0).state is TicketState.REJECTED
    assert adm.arrive(5.0).state is Q  # the stale waiter's place was freed at its deadline
    assert stale.state is TicketState.EXPIRED


def test_leaving_the_queue_before_the_deadline() -> None:
    adm = Admission(limit=1, max_queue=10, max_wait=5)
    running = adm.arrive(0.0)
    gone, staying = adm.arrive(0.0), adm.arrive(0.0)
    assert adm.finish(gone, 1.0) == []
    assert gone.state is TicketState.CANCELLED and adm.queued == 1
    assert adm.finish(running, 2.0) == [staying]


def test_finishing_a_just_admitted_waiter_passes_the_slot_on() -> None:
    """The wrapper's race: the slot reaches a waiter in the same instant it is cancelled."""
    adm = Admission(limit=1, max_queue=10, max_wait=5)
    running = adm.arrive(0.0)
    a, b = adm.arrive(0.0), adm.arrive(0.0)
    assert adm.finish(running, 1.0) == [a]
    assert adm.finish(a, 1.0) == [b]  # a went away before using it
    assert adm.finish(b, 2.0) == [] and adm.in_flight == 0


def test_retry_after_follows_the_service_time() -> None:
    adm = Admission(limit=2, max_queue=4, max_wait=30)
    assert adm.retry_after(0.0) == 1  # nothing measured yet
    for _ in range(20):  # requests take 8 s each
        t = adm.arrive(0.0)
        adm.finish(t, 8.0)
    assert adm.service_time is not None and abs(adm.service_time - 8.0) < 1e-9
    adm.arrive(100.0), adm.arrive(100.0)
    for _ in range(4):
        adm.arrive(100.0)
    full = adm.arrive(100.0)
    # 4 waiters ahead + itself, 2 slots, 8 s each: 20 s
    assert full.state is TicketState.REJECTED and full.retry_after == 20
    slow = Admission(limit=1, max_queue=1, max_wait=10)
    slow.finish(slow.arrive(0.0), 1000.0)
    slow.arrive(1000.0), slow.arrive(1000.0)
    assert slow.arrive(1000.0).retry_after == 60  # capped


def test_raising_the_limit_admits_waiters() -> None:
    adm = Admission(limit=1, max_queue=10, max_wait=5)
    adm.arrive(0.0)
    waiters = [adm.arrive(0.0) for _ in range(3)]
    assert adm.set_limits(1.0, limit=3, max_queue=10, max_wait=5) == waiters[:2]
    assert adm.in_flight == 3 and adm.queued == 1
    assert adm.set_limits(1.0, limit=0, max_queue=10, max_wait=5) == waiters[2:]


def test_lowering_the_limit_lets_requests_in_flight_finish() -> None:
    adm = Admission(limit=3, max_queue=10, max_wait=50)
    running = [adm.arrive(0.0) for _ in range(3)]
    adm.set_limits(0.0, limit=1, max_queue=10, max_wait=50)
    waiter = adm.arrive(0.0)
    assert waiter.state is Q
    assert adm.finish(running[0], 1.0) == []
    assert adm.finish(running[1], 1.0) == []
    assert adm.finish(running[2], 1.0) == [waiter]


@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["arrive", "finish", "tick"]), st.integers(0, 50)),
        max_size=200,
    ),
    limit=st.integers(0, 4),
    max_queue=st.integers(0, 4),
)
def test_invariants(ops: list[tuple[str, int]], limit: int, max_queue: int) -> None:
    """Whatever the order of events: slots in use never exceed the limit, the count of
    admitted-and-unfinished tickets is `in_flight`, nobody waits while a slot is free, and
    admission follows arrival order."""
    adm = Admission(limit=limit, max_queue=max_queue, max_wait=3)
    now = 0.0
    live: list[Ticket] = []
    admitted_order: list[int] = []
    for op, n in ops:
        if op == "tick":
            now += n / 10
            continue
        if op == "arrive":
            t = adm.arrive(now)
            if t.state is A:
                admitted_order.append(t.seq)
            live.append(t)
        elif live:
            t = live.pop(n % len(live))
            for w in adm.finish(t, now):
                assert w.state is A and w.admitted_at == now
                admitted_order.append(w.seq)
        holding = [t for t in live if t.state is A]
        assert adm.in_flight == len(holding)
        if limit:
            assert adm.in_flight <= limit
            if adm.queued:
                assert adm.in_flight == limit
        else:
            assert adm.queued == 0
        assert adm.queued <= max_queue
    assert admitted_order == sorted(admitted_order)
