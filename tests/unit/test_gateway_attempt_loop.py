"""The attempt loop, driven with no socket and no event loop (issue 42): the sequence both request
paths share, each step and what it hands back to the balancer and the metrics."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.server.gateway.attempt import AttemptLoop
from llmgw.server.gateway.balance import Balancer
from llmgw.server.gateway.phases import ENDED, NEXT, IllegalStep, Phase
from llmgw.server.gateway.retry import RetryBudget

ENDPOINTS = ("http://a:8000", "http://b:8000", "http://c:8000")


def loop_over(*endpoints: str, max_attempts: int = 3, budget: RetryBudget | None = None,
              streaming: bool = False) -> tuple[AttemptLoop, Balancer]:
    balancer = Balancer(rng=random.Random(7))
    balancer.set_endpoints(endpoints)
    return AttemptLoop(balancer, budget or RetryBudget(), max_attempts, 0.0, streaming=streaming), balancer


def outstanding(balancer: Balancer) -> int:
    return sum(s.outstanding for s in balancer.status())


def test_a_good_answer_is_one_attempt_and_one_release() -> None:
    loop, balancer = loop_over(*ENDPOINTS)
    pick = loop.pick(0.0)
    assert pick is not None and loop.phase is Phase.ATTEMPT and outstanding(balancer) == 1
    assert loop.head(200, 0.1) is Phase.ANSWER
    loop.finish(True)
    assert loop.phase is Phase.DONE
    assert loop.take_release() == (pick, True) and loop.take_release() is None
    assert loop.retried is None and loop.attempt == 1


def test_a_connect_error_is_retried_on_another_endpoint() -> None:
    loop, _ = loop_over(*ENDPOINTS)
    first = loop.pick(0.0)
    assert first is not None
    assert loop.failed("connect", "connection refused", 0.1) is Phase.PICK
    assert loop.take_release() == (first, False) and loop.retried == "connect"
    second = loop.pick(0.2)
    assert second is not None and second.endpoint != first.endpoint and loop.attempt == 2
    assert loop.last_error == f"{first.endpoint}: connection refused"


def test_max_attempts_ends_in_a_502_naming_the_reason() -> None:
    loop, _ = loop_over(*ENDPOINTS, max_attempts=2)
    for _ in range(2):
        assert loop.pick(0.0) is not None
        phase = loop.failed("reset", "reset by peer", 0.0)
        loop.take_release()
    assert phase is Phase.FAILED and loop.status == 502 and "max attempts reached" in loop.detail


def test_a_timeout_is_a_504_and_not_retried_unless_a_stream_had_no_head() -> None:
    plain, _ = loop_over(*ENDPOINTS)
    plain.pick(0.0)
    assert plain.failed("timeout", "no answer in 600s", 0.0) is Phase.FAILED and plain.status == 504
    stream, _ = loop_over(*ENDPOINTS, streaming=True)
    stream.pick(0.0)
    assert stream.failed("timeout", "no head in 5s", 0.0) is Phase.PICK and stream.retried == "no_head"
    assert stream.last_error.endswith("(stream_head_timeout)")


def test_a_503_is_retried_and_a_500_is_the_answer() -> None:
    loop, _ = loop_over(*ENDPOINTS)
    first = loop.pick(0.0)
    assert loop.head(503, 0.0) is Phase.PICK and loop.retried == "503"
    assert loop.take_release() == (first, False)
    loop.pick(0.0)
    assert loop.head(500, 0.0) is Phase.ANSWER
    loop.finish(True)
    assert loop.take_release()[1] is True  # type: ignore[index]


def test_a_503_not_retried_is_passed_on_as_a_failure_of_its_engine() -> None:
    loop, _ = loop_over(ENDPOINTS[0], max_attempts=1)
    loop.pick(0.0)
    assert loop.head(503, 0.0) is Phase.ANSWER
    loop.finish(True)  # the relay itself went fine; the engine still failed
    assert loop.take_release()[1] is False  # type: ignore[index]


def test_an_eviction_moves_the_request_without_spending_an_attempt_or_the_budget() -> None:
    budget = RetryBudget(0.0, min_retries=0)  # no retry allowed at all
    loop, _ = loop_over(*ENDPOINTS, max_attempts=1, budget=budget)
    first = loop.pick(0.0)
    assert loop.evicted("failing its health checks") is Phase.PICK and loop.retried == "unhealthy"
    assert loop.take_release() == (first, False)
    second = loop.pick(0.0)
    assert second is not None and second.endpoint != first.endpoint  # type: ignore[union-attr]
    assert loop.attempt == 1


def test_no_endpoint_left_is_unavailable_with_the_last_error() -> None:
    loop, _ = loop_over(ENDPOINTS[0])
    loop.pick(0.0)
    loop.failed("connect", "refused", 0.0)
    loop.take_release()
    assert loop.pick(0.0) is None and loop.phase is Phase.UNAVAILABLE
    assert loop.last_error.endswith("refused")


def test_a_client_gone_mid_attempt_gives_no_outcome_and_ends_the_loop() -> None:
    loop, _ = loop_over(*ENDPOINTS)
    pick = loop.pick(0.0)
    loop.gone()
    assert loop.phase is Phase.GONE and loop.take_release() == (pick, None)
    loop.gone()  # once ended, a second hang-up is nothing
    assert loop.take_release() is None


def test_steps_out_of_order_are_refused() -> None:
    loop, _ = loop_over(*ENDPOINTS)
    with pytest.raises(IllegalStep):
        loop.finish(True)  # no attempt has an answer yet
    loop.pick(0.0)
    with pytest.raises(IllegalStep):
        loop.pick(0.0)  # one attempt at a time
    loop.head(200, 0.0)
    loop.finish(True)
    with pytest.raises(IllegalStep):
        loop.head(200, 0.0)


def test_the_table_has_every_phase_and_the_ended_phases_lead_nowhere() -> None:
    assert set(NEXT) == set(Phase)
    assert {Phase.UNAVAILABLE, Phase.FAILED, Phase.DONE, Phase.GONE} == ENDED
    for phase, onward in NEXT.items():
        assert onward <= set(Phase), phase


STEP = st.sampled_from(["connect", "reset", "timeout", "502", "503", "200", "evicted", "gone"])


@settings(max_examples=300, deadline=None)
@given(st.lists(STEP, max_size=12), st.integers(1, 4))
def test_whatever_happens_every_pick_is_released_once(steps: list[str], max_attempts: int) -> None:
    """Any sequence of attempt outcomes ends with nothing outstanding on the balancer and an ended
    phase or a pick to make: no hold is lost or given back twice."""
    loop, balancer = loop_over(*ENDPOINTS, max_attempts=max_attempts)
    for step in steps:
        if loop.phase is Phase.PICK and loop.pick(0.0) is None:
            break
        if loop.phase in ENDED:
            break
        if step in ("connect", "reset", "timeout"):
            loop.failed(step, "x", 0.0)
        elif step in ("502", "503", "200"):
            if loop.head(int(step), 0.0) is Phase.ANSWER:
                loop.finish(True)
        elif step == "evicted":
            loop.evicted("x")
        else:
            loop.gone()
        released = loop.take_release()
        assert released is None or not released[0].released
        if released is not None:
            balancer.release(released[0], 0.0, ok=released[1])
    if loop.phase not in ENDED:
        loop.gone()
        released = loop.take_release()
        if released is not None:
            balancer.release(released[0], 0.0, ok=released[1])
    assert outstanding(balancer) == 0
    assert loop.attempt <= max_attempts + len(ENDPOINTS)
