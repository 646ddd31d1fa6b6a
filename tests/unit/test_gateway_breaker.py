"""Circuit breaker transitions, driven by a fake clock (a plain float)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.server.gateway.breaker import Breaker, BreakerState


def fail(b: Breaker, now: float, n: int = 1, reason: str = "connect refused") -> None:
    for _ in range(n):
        b.failure(now, b.start(now), reason)


def test_consecutive_failures_open_it() -> None:
    b = Breaker(failures=3, cooldown=10)
    fail(b, 0.0, 2)
    assert b.state is BreakerState.CLOSED and b.allows(0.0)
    b.success(0.0, b.start(0.0))  # a success resets the count: failures must be consecutive
    fail(b, 1.0, 2)
    assert b.state is BreakerState.CLOSED
    fail(b, 2.0)
    assert b.state is BreakerState.OPEN
    assert int(b.state) == 1 and b.state.label == "open"
    assert b.reason == "3 consecutive failures, last: connect refused"
    assert not b.allows(2.0) and not b.allows(11.9)
    assert b.retry_at == 12.0


def test_one_probe_after_cooldown_then_success_closes() -> None:
    b = Breaker(failures=1, cooldown=10)
    fail(b, 0.0)
    assert b.allows(10.0)
    probe = b.start(10.0)
    assert b.state is BreakerState.HALF_OPEN and int(b.state) == 2
    assert b.state.label == "half-open"
    assert not b.allows(10.0) and not b.allows(500.0)  # only one probe at a time
    b.success(10.5, probe)
    assert b.state is BreakerState.CLOSED and int(b.state) == 0
    assert b.allows(10.5) and b.reason == ""


def test_failed_probe_reopens_with_a_longer_cooldown_capped() -> None:
    b = Breaker(failures=1, cooldown=10, max_cooldown=35)
    fail(b, 0.0)
    now = 10.0
    for expected in (20, 35, 35):
        fail(b, now, reason="reset")
        assert b.state is BreakerState.OPEN and b.reason == "probe failed: reset"
        assert b.retry_at == now + expected
        assert not b.allows(now + expected - 0.001)
        now += expected
    b.success(now, b.start(now))
    assert b.state is BreakerState.CLOSED
    fail(b, now)  # closed again: the cool-down is back to the base
    assert b.retry_at == now + 10


def test_stale_outcomes_are_ignored() -> None:
    b = Breaker(failures=2, cooldown=10)
    old = b.start(0.0)  # in flight while the breaker opens
    fail(b, 0.0, 2)
    assert b.state is BreakerState.OPEN
    b.success(1.0, old)  # from before the opening: says nothing about now
    assert b.state is BreakerState.OPEN
    probe = b.start(10.0)
    b.failure(10.1, old)  # stale failure does not decide the half-open breaker
    assert b.state is BreakerState.HALF_OPEN
    b.success(10.2, probe)
    assert b.state is BreakerState.CLOSED


def test_cancelled_probe_frees_the_probe_slot_at_once() -> None:
    b = Breaker(failures=1, cooldown=10)
    fail(b, 0.0)
    probe = b.start(10.0)
    b.cancel(11.0, probe)
    assert b.state is BreakerState.OPEN and b.allows(11.0)
    b.cancel(11.0, b.start(11.0) - 1)  # a stale cancel changes nothing
    assert b.state is BreakerState.HALF_OPEN


@given(
    events=st.lists(
        st.tuples(st.floats(min_value=0, max_value=5), st.sampled_from(["ok", "fail", "cancel"])),
        max_size=60,
    )
)
def test_never_more_than_one_probe_in_flight(events: list[tuple[float, str]]) -> None:
    """Whatever the outcomes, an open breaker lets requests through one at a time: between a
    probe's start and its outcome nothing else gets through."""
    b = Breaker(failures=2, cooldown=1)
    now = 0.0
    in_flight: list[int] = []
    probe_out = False
    for dt, outcome in events:
        now += dt
        if b.allows(now):
            assert not probe_out
            was_open = b.state is BreakerState.OPEN
            in_flight.append(b.start(now))
            probe_out = was_open
            if was_open:
                assert b.state is BreakerState.HALF_OPEN
                assert not b.allows(now) and not b.allows(now + 1e9)
        if in_flight:
            token = in_flight.pop(0)
            {"ok": b.success, "fail": b.failure, "cancel": b.cancel}[outcome](now, token)
            if b.state is not BreakerState.HALF_OPEN:
                probe_out = False


def test_with_health_probes_an_open_breaker_lets_no_client_through() -> None:
    """Issue 9: the half-open probe is a health check, not a client's request (a client probing
    a hung engine hung with it)."""
    b = Breaker(failures=2, cooldown=10, health_probes=True)
    fail(b, 0.0, 2)
    assert b.state is BreakerState.OPEN
    assert not b.allows(5.0) and not b.allows(100.0)  # cool-down over: still no client
    b.start(100.0)
    assert b.state is BreakerState.OPEN  # a request that got through anyway is not the probe
    b.probe(5.0, ok=True)
    assert b.state is BreakerState.OPEN  # before the cool-down a passing check decides nothing
    b.probe(10.0, ok=False, reason="no answer to /health within 1s")
    assert b.state is BreakerState.OPEN and b.retry_at == 30.0  # cool-down doubled
    assert b.reason == "health probe failed: no answer to /health within 1s"
    b.probe(30.0, ok=True)
    assert b.state is BreakerState.CLOSED and b.allows(30.0) and b.cooldown == 10
    b.probe(31.0, ok=False)
    assert b.state is BreakerState.CLOSED  # a closed breaker counts requests, not health checks
