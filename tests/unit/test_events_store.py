"""The event log's store (server/events.py) and the agent's log streams (agent/logs.py), alone.

The end-to-end tests (tests/e2e/test_events_logs.py) cover a real server restart, a corrupt
file and `ctl logs -f`; these cover what is hard to provoke there: a directory that cannot be
written, retention, the filters, and credit-based backpressure holding the agent's reading.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import trio
import trio.testing

from llmgw.agent.logs import CHUNK_BYTES, LogSource, LogStreams, chunks, read_new, read_tail
from llmgw.server.events import EventLog, EventQuery, breaker_events, replica_events
from llmgw.wire import messages as m


class Sent(list[m.LogChunk]):
    """What the agent sent, and a way to wait (with a deadline) until it has sent `n`."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = trio.Event()

    def __call__(self, msg: msgspec.Struct) -> None:
        assert isinstance(msg, m.LogChunk)
        self.append(msg)
        self.changed.set()

    async def until(self, n: int, within: float = 5.0) -> None:
        with trio.fail_after(within):
            while len(self) < n:
                self.changed = trio.Event()
                await self.changed.wait()


async def test_events_are_kept_filtered_and_pruned(tmp_path: Path) -> None:
    now = [1_000_000.0]
    events = EventLog(tmp_path, retention=3600, clock=lambda: now[0])
    await events.open()
    events.record("node", "node gpu-01: new → ready", node="gpu-01")
    events.record("replica", "replica chat-a failed: exit 1", node="gpu-01", model="chat", replica="chat-a",
                  detail=[f"line {i}\x1b[2J" for i in range(50)])
    now[0] += 7200
    events.record("reload", "config reloaded")
    got = await events.query(EventQuery())
    assert [e.kind for e in got] == ["node", "replica", "reload"]
    failed = got[1]
    assert len(failed.detail) == 20 and failed.detail[-1].startswith("line 49") and "\x1b" not in failed.detail[-1]
    assert [e.kind for e in await events.query(EventQuery(model="chat"))] == ["replica"]
    assert [e.kind for e in await events.query(EventQuery(node="gpu-01"))] == ["node", "replica"]
    assert [e.kind for e in await events.query(EventQuery(after=got[0].id))] == ["replica", "reload"]
    assert [e.kind for e in await events.query(EventQuery(since=now[0] - 10))] == ["reload"]
    assert await events.prune() == 2  # older than the retention (an hour)
    assert [e.kind for e in await events.query(EventQuery())] == ["reload"]


async def test_a_directory_that_cannot_be_written_keeps_events_in_memory(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "state"
    blocked.write_text("a file where the state directory should be")
    events = EventLog(blocked)
    with caplog.at_level(logging.WARNING):
        await events.open()
    assert events.degraded and "in memory only" in caplog.text
    events.record("reload", "config reloaded")
    events.record("node", "node gpu-01: new → ready", node="gpu-01")
    got = await events.query(EventQuery(node="gpu-01"))
    assert [e.message for e in got] == ["node gpu-01: new → ready"] and got[0].id == 2


async def test_a_write_that_fails_degrades_instead_of_crashing(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    events = EventLog(tmp_path)
    await events.open()
    assert events.db is not None
    events.db.close()  # as a vanished or read-only file would: every statement now fails
    events.record("reload", "config reloaded")
    with caplog.at_level(logging.WARNING):
        got = await events.query(EventQuery())
    assert [e.kind for e in got] == ["reload"] and events.degraded and "in memory only" in caplog.text


async def test_a_corrupt_file_is_moved_aside(tmp_path: Path) -> None:
    (tmp_path / "events.db").write_bytes(b"\x00garbage" * 1000)
    events = EventLog(tmp_path)
    await events.open()
    assert events.db is not None and not events.degraded
    assert len(list(tmp_path.glob("events.db.corrupt-*"))) == 1  # noqa: ASYNC240 - a test's own tmp dir
    events.record("reload", "config reloaded")
    assert len(await events.query(EventQuery())) == 1


async def test_replica_and_breaker_transitions_become_events(tmp_path: Path) -> None:
    events = EventLog(tmp_path)
    await events.open()
    shard = SimpleNamespace(shard_id="chat-a.1", node="gpu-01", rank=0, gpus=[0], port=20001)
    replica = SimpleNamespace(id="chat-a", model="chat", profile="tp1", state="starting", reason="", tail=[],
                              adopted=False,
                              shards=[shard])
    seen: dict = {}
    replica_events(seen, [replica], events)
    replica_events(seen, [replica], events)  # nothing changed: nothing recorded
    replica.state, replica.reason, replica.tail = "failed", "gpu-01: exit 1 during startup", ["Traceback", "OOM"]
    replica_events(seen, [replica], events)
    replica_events(seen, [], events)
    breakers: dict = {}
    row = {"model": "chat", "endpoint": "http://10.0.0.1:20001", "breaker": "open", "breaker_reason": "5 failures"}
    breaker_events(breakers, [row], events)
    breaker_events(breakers, [{**row, "breaker": "half-open"}], events)
    breaker_events(breakers, [{**row, "breaker": "closed"}], events)
    got = await events.query(EventQuery())
    assert [(e.kind, e.message.split(":")[0]) for e in got] == [
        ("placement", "placed chat-a (chat/tp1) on gpu-01 GPUs [0] port 20001"),
        ("replica", "replica chat-a failed"),
        ("replica", "replica chat-a stopped and removed"),
        ("breaker", "breaker of http"),
        ("breaker", "breaker of http"),
    ]
    assert got[1].detail == ["Traceback", "OOM"] and got[0].node == "gpu-01" and got[1].model == "chat"
    assert "opened" in got[3].message and "closed" in got[4].message


@pytest.mark.parametrize("durable", [True, False], ids=["sqlite", "memory"])
async def test_a_replica_on_two_nodes_is_found_by_either(tmp_path: Path, durable: bool) -> None:
    """Issue 46: a 2-node replica's events carried no node, so `events --node` found them on neither."""
    events = EventLog(tmp_path if durable else tmp_path / "file" / "not-a-dir")
    if not durable:
        (tmp_path / "file").write_text("a file where a directory should be")
    await events.open()
    assert bool(events.degraded) is not durable
    shards = [SimpleNamespace(shard_id=f"big-a.1.{rank}", node=node, rank=rank, gpus=[0], port=20001)
              for rank, node in ((1, "gpu-02"), (0, "gpu-01"))]
    replica = SimpleNamespace(id="big-a", model="big", profile="two", state="starting", reason="", tail=[],
                              adopted=False,
                              shards=shards)
    replica_events({}, [replica], events)
    events.record("drain", "move of big-a asked", node="gpu-02", nodes=["gpu-01", "gpu-02"], model="big")
    events.record("node", "node gpu-010 cordoned", node="gpu-010")
    for node in ("gpu-01", "gpu-02"):
        got = await events.query(EventQuery(node=node))
        assert [e.kind for e in got] == ["placement", "drain"], (node, got)
        assert got[0].node == "gpu-01" and got[0].nodes == ["gpu-01", "gpu-02"]  # rank 0's, and both
        assert got[1].node == "gpu-02"  # the drained node, not rank 0's
    assert [e.kind for e in await events.query(EventQuery(node="gpu-0"))] == []


async def test_an_events_file_from_before_nodes_gains_the_column(tmp_path: Path) -> None:
    import sqlite3

    db = sqlite3.connect(tmp_path / "events.db")
    db.executescript(
        """CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, kind TEXT NOT NULL,
        node TEXT NOT NULL DEFAULT '', model TEXT NOT NULL DEFAULT '', replica TEXT NOT NULL DEFAULT '',
        message TEXT NOT NULL, detail TEXT NOT NULL DEFAULT '');
        INSERT INTO events (time, kind, node, message) VALUES (1, 'node', 'gpu-01', 'old');""")
    db.close()
    events = EventLog(tmp_path, retention=1e12)
    await events.open()
    assert not events.degraded
    events.record("port", "port mlx5_0/1 on gpu-01: ACTIVE → INIT", node="gpu-01")
    assert [e.message for e in await events.query(EventQuery(node="gpu-01"))] == [
        "old", "port mlx5_0/1 on gpu-01: ACTIVE → INIT"]


# -- the agent's side of `ctl logs` -------------------------------------------------------------


def test_tail_and_follow_read_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    path.write_text("one\ntwo\nthree\npart")
    lines, offset = read_tail(str(path), 2)
    assert lines == ["two", "three"] and offset == len("one\ntwo\nthree\n")
    assert read_new(str(path), offset) == ([], offset)  # half a line waits for its end
    with open(path, "a") as fh:
        fh.write("ial\nfour\n")
    lines, offset = read_new(str(path), offset)
    assert lines == ["partial", "four"] and offset == path.stat().st_size
    path.write_text("new\n")  # replaced: read from its start
    assert read_new(str(path), offset)[0] == ["new"]
    big = chunks(["x" * 1000] * 100)
    assert all(sum(len(line) + 1 for line in c) <= CHUNK_BYTES + 1001 for c in big) and sum(map(len, big)) == 100


async def test_a_reader_that_gives_no_credit_stops_the_agent_reading(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    path.write_text("".join(f"line {i:06d} " + "x" * 200 + "\n" for i in range(20_000)))  # ~4 MB
    sent = Sent()
    streams = LogStreams(lambda shard: LogSource(str(path), redact=lambda s: s.replace("secret", "<key>"),
                                                 alive=lambda: True)
                         if shard == "chat-a.1" else None)

    send = sent
    async with trio.open_nursery() as nursery:
        await nursery.start(streams.run)
        streams.handle(m.LogTail(request_id="r1", shard_id="chat-a.1", tail=10_000, follow=True, credit=2), send)
        streams.handle(m.LogTail(request_id="r2", shard_id="other.1"), send)
        await sent.until(3)  # two chunks and a refusal
        await trio.testing.wait_all_tasks_blocked()
        refusal = next(c for c in sent if c.request_id == "r2")
        assert refusal.eof and "does not run on this node" in refusal.error
        assert len([c for c in sent if c.request_id == "r1"]) == 2  # the credit, and no more
        streams.handle(m.LogCredit(request_id="r1", credit=1), send)
        await sent.until(4)  # one more chunk for one more credit
        await trio.testing.wait_all_tasks_blocked()
        assert len(sent) == 4
        streams.handle(m.LogCancel(request_id="r1"), send)
        await trio.testing.wait_all_tasks_blocked()
        assert not streams.streams
        nursery.cancel_scope.cancel()
