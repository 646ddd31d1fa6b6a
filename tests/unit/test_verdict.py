from hypothesis import given
from hypothesis import strategies as st

from llmgw.verdict import (
    EXIT_CRIT,
    EXIT_OK,
    EXIT_UNKNOWN,
    EXIT_WARN,
    Status,
    exit_code,
    grade_ratio,
    worst,
)


def test_exit_codes_follow_the_nagios_convention() -> None:
    assert exit_code([]) == EXIT_OK == 0
    assert exit_code([Status.OK, Status.OK]) == 0
    assert exit_code([Status.OK, Status.WARN]) == EXIT_WARN == 1
    assert exit_code([Status.WARN, Status.CRIT, Status.OK]) == EXIT_CRIT == 2
    assert exit_code([Status.OK, Status.UNKNOWN]) == EXIT_UNKNOWN == 3


def test_a_problem_outranks_an_unknown() -> None:
    assert exit_code([Status.UNKNOWN, Status.WARN]) == 1
    assert exit_code([Status.CRIT, Status.UNKNOWN]) == 2


@given(st.lists(st.sampled_from(list(Status))))
def test_worst_is_one_of_the_inputs_or_ok(statuses: list[Status]) -> None:
    w = worst(statuses)
    assert w in statuses or (w is Status.OK and not statuses)


def test_grading_against_the_expected_rate() -> None:
    assert grade_ratio(90.0, 100.0) is Status.OK
    assert grade_ratio(89.9, 100.0) is Status.WARN
    assert grade_ratio(70.0, 100.0) is Status.WARN
    assert grade_ratio(69.9, 100.0) is Status.CRIT
    assert grade_ratio(0.0, 100.0) is Status.CRIT
    assert grade_ratio(50.0, 0.0) is Status.UNKNOWN
