"""llmgw.errors: the one place that looks inside trio's exception groups."""

from __future__ import annotations

import pytest
import trio

from llmgw.errors import LlmgwError, UsageError, first_leaf, leaves, unwrap


class Refused(Exception):
    pass


def nested() -> BaseExceptionGroup:
    return BaseExceptionGroup(
        "outer", [ValueError("a"), BaseExceptionGroup("inner", [Refused("b"), KeyError("c")]), Refused("d")]
    )


def test_leaves_are_depth_first_and_a_lone_exception_is_its_own_leaf() -> None:
    assert [str(e) for e in leaves(nested())] == ["a", "b", "'c'", "d"]
    lone = ValueError("x")
    assert leaves(lone) == [lone]


def test_first_leaf_finds_the_first_of_a_kind_in_nested_groups() -> None:
    assert str(first_leaf(nested(), Refused)) == "b"
    with pytest.raises(LookupError):
        first_leaf(nested(), OSError)


async def test_first_leaf_on_what_a_nursery_raises() -> None:
    async def fail() -> None:
        raise Refused("from a task")

    try:
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as inner:
                inner.start_soon(fail)
            outer.start_soon(trio.sleep_forever)
    except* Refused as group:
        assert str(first_leaf(group, Refused)) == "from a task"


def test_unwrap_reports_operator_errors_and_ctrl_c_alone_and_keeps_bugs_grouped() -> None:
    usage = UsageError("bad flag")
    assert unwrap(BaseExceptionGroup("g", [BaseExceptionGroup("h", [usage])])) is usage
    ctrl_c = KeyboardInterrupt()
    assert unwrap(BaseExceptionGroup("g", [ctrl_c, KeyboardInterrupt()])) is ctrl_c
    mixed = BaseExceptionGroup("g", [LlmgwError("x"), RuntimeError("bug")])
    assert unwrap(mixed) is mixed
