"""What `--watch -o json` prints after each poll (llmgw.cli.watching.changes)."""

from __future__ import annotations

from llmgw.cli.watching import changes


def test_new_changed_and_gone_objects_each_a_line_and_volatile_fields_are_no_change():
    key = lambda item: item["id"]  # noqa: E731
    state, lines = changes({}, [{"id": "a", "state": "ready", "age": 1}, {"id": "b", "state": "starting", "age": 1}],
                           key, ("age",))
    assert [x["id"] for x in lines] == ["a", "b"]
    state, lines = changes(state, [{"id": "a", "state": "ready", "age": 9}, {"id": "b", "state": "ready", "age": 9}],
                           key, ("age",))
    assert lines == [{"id": "b", "state": "ready", "age": 9}]  # a's age alone changed: not printed
    state, lines = changes(state, [{"id": "b", "state": "ready", "age": 12}], key, ("age",))
    assert lines == [{"id": "a", "deleted": True}]
    assert changes(state, [], key, ())[1] == [{"id": "b", "deleted": True}]
