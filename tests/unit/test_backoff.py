"""Reconnect backoff: bounds, cap, spread."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.backoff import Backoff


@given(
    initial=st.floats(min_value=0.01, max_value=5),
    cap=st.floats(min_value=5, max_value=60),
    seed=st.integers(),
    n=st.integers(min_value=1, max_value=80),
)
def test_each_delay_within_half_to_full_ceiling(initial: float, cap: float, seed: int, n: int) -> None:
    b = Backoff(initial, cap, random.Random(seed))
    for attempt in range(n):
        top = min(cap, initial * 2**attempt)
        delay = b.next()
        assert top / 2 <= delay <= top
        assert delay <= cap


def test_reaches_cap_and_resets() -> None:
    b = Backoff(0.5, 30, random.Random(1))
    delays = [b.next() for _ in range(12)]
    assert max(delays) <= 30
    assert delays[-1] >= 15  # at the cap, delays stay in [cap/2, cap]
    b.reset()
    assert b.next() <= 0.5


def test_fleet_does_not_reconnect_in_lockstep() -> None:
    # 1,000 agents whose server restarted: their 5th delays must spread over the window.
    delays = []
    for seed in range(1000):
        b = Backoff(0.5, 30, random.Random(seed))
        for _ in range(4):
            b.next()
        delays.append(b.next())
    assert min(delays) >= 4.0 and max(delays) <= 8.0
    buckets = {int(d) for d in delays}
    assert buckets == {4, 5, 6, 7}
    # No 100 ms window gets more than a small share of the fleet (uniform would be 2.5 %).
    per_window: dict[int, int] = {}
    for d in delays:
        per_window[int(d * 10)] = per_window.get(int(d * 10), 0) + 1
    assert max(per_window.values()) < 60


def test_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        Backoff(0, 30)
    with pytest.raises(ValueError):
        Backoff(10, 5)
