"""Retry decisions and the retry budget, with a fake clock."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.server.gateway.retry import RetryBudget, is_retryable, should_retry


def decide(budget: RetryBudget, now: float = 0.0, **kw: object) -> str:
    args: dict[str, object] = {
        "failure": "connect",
        "status": None,
        "sent_to_client": False,
        "attempt": 1,
        "max_attempts": 3,
    }
    args.update(kw)
    return should_retry(budget=budget, now=now, **args).reason  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("failure", "status", "retryable"),
    [
        ("connect", None, True),
        ("reset", None, True),
        ("status", 502, True),
        ("status", 503, True),
        ("status", 500, False),
        ("status", 504, False),
        ("status", 429, False),
        ("timeout", None, False),
        ("other", None, False),
    ],
)
def test_what_is_retryable(failure: str, status: int | None, retryable: bool) -> None:
    assert is_retryable(failure, status) is retryable  # type: ignore[arg-type]
    expected = "retry" if retryable else "not retryable"
    assert decide(RetryBudget(), failure=failure, status=status).startswith(expected)


def test_never_after_a_byte_went_to_the_client() -> None:
    budget = RetryBudget()
    assert decide(budget, sent_to_client=True) == "response already started"
    assert budget.retries_in_window == 0  # the budget is only spent on a yes


def test_max_attempts() -> None:
    budget = RetryBudget()
    assert decide(budget, attempt=2, max_attempts=3) == "retry"
    assert decide(budget, attempt=3, max_attempts=3) == "max attempts reached"
    assert decide(budget, attempt=1, max_attempts=1) == "max attempts reached"


def test_a_lone_request_can_still_retry() -> None:
    budget = RetryBudget(0.2, min_retries=2)
    budget.record_request(0.0)
    assert decide(budget, attempt=1) == "retry"
    assert decide(budget, attempt=2) == "retry"
    assert decide(budget, attempt=1) == "retry budget exhausted"


def test_budget_refills_as_the_window_slides() -> None:
    budget = RetryBudget(0.5, window=10, min_retries=0, buckets=10)
    for _ in range(4):
        budget.record_request(0.0)
    assert budget.try_spend(0.5) and budget.try_spend(0.5)
    assert not budget.try_spend(9.9)  # 2 of 4 × 0.5 spent
    assert budget.allowance(10.0) == 0  # the bucket of t=0 has left the window
    for _ in range(2):
        budget.record_request(10.0)
    assert budget.try_spend(10.0)
    assert not budget.try_spend(10.0)


def test_outage_retries_stay_within_budget() -> None:
    """Every attempt fails for 5 minutes at 20 requests/s: without a budget each request
    would be tried 3 times (2 retries each); with it retries are ~20 % of the requests."""
    budget = RetryBudget(0.2, window=10, min_retries=5)
    requests = retries = 0
    for tick in range(300 * 20):
        now = tick / 20
        budget.record_request(now)
        requests += 1
        attempt = 1
        while should_retry(
            failure="connect",
            sent_to_client=False,
            attempt=attempt,
            max_attempts=3,
            budget=budget,
            now=now,
        ).retry:
            retries += 1
            attempt += 1
    assert requests == 6000
    assert retries <= 0.2 * requests + 5 * (300 / 10 + 1)
    assert retries >= 0.19 * requests  # and the budget is actually used


@settings(max_examples=200)
@given(
    gaps=st.lists(st.floats(min_value=0, max_value=3), min_size=1, max_size=200),
    ratio=st.sampled_from([0.1, 0.2, 0.5]),
    min_retries=st.integers(0, 3),
)
def test_granted_retries_never_exceed_the_window_budget(
    gaps: list[float], ratio: float, min_retries: int
) -> None:
    """Against a brute-force recount: at every granted retry, the retries granted within the
    window (the current bucket and the 9 before it) are ≤ max(min, ratio × requests in it)."""
    budget = RetryBudget(ratio, window=10, min_retries=min_retries, buckets=10)
    now = 0.0
    request_times: list[float] = []
    retry_times: list[float] = []
    for gap in gaps:
        now += gap
        budget.record_request(now)
        request_times.append(now)
        for _ in range(3):  # every attempt fails; up to 2 retries each
            if not budget.try_spend(now):
                break
            retry_times.append(now)
            start = (math.floor(now) - 9) * 1.0  # bucket length 1 s
            reqs = sum(1 for t in request_times if t >= start)
            rets = sum(1 for t in retry_times if t >= start)
            assert rets <= max(min_retries, math.floor(ratio * reqs))
