"""Bounded outboxes on both ends of the fleet stream (fleet/outbox.py): a peer that stops reading
costs at most `capacity` queued messages. Replaceable messages (heartbeats, progress) are
dropped when full; anything else ends the stream as a slow consumer, and the agent reconnects
(its Register puts both views right). The server's case runs on the real stream: a real
FleetListener and FleetService, and a dialed agent that stops reading."""

from __future__ import annotations

import logging
import math
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import pytest
import trio
import trio.testing

from llmgw import __version__
from llmgw.agent.agent import Agent
from llmgw.fleet import ChannelClosed, dial
from llmgw.fleet.outbox import Outbox
from llmgw.server.fleet_service import FleetService
from llmgw.server.metrics import ServerMetrics
from llmgw.server.registry import NodeRegistry
from llmgw.wire import messages as m
from tests.unit.fakes import NoHardware
from tests.unit.test_agent_reconnect import HEARTBEAT, FakeConnection, ScriptedDialer, config
from tests.unit.test_fleet_flow import DEADLINE, MAX, fleet_port, until

STATUS = m.ShardStatus(shard_id="r.1", replica_id="r", state="ready")


async def test_a_full_outbox_drops_replaceable_messages_and_overflows_on_others() -> None:
    box = Outbox(2, replaceable=(m.Heartbeat,))
    assert box.put(m.Heartbeat(seq=1)) and box.put(STATUS)
    assert not box.put(m.Heartbeat(seq=2)) and box.dropped == 1 and not box.overflow.is_set()
    assert not box.put(STATUS) and box.overflow.is_set()
    assert box.reason == "slow consumer: 2 messages queued and unread by the peer when a ShardStatus was added"
    assert not box.put(m.Heartbeat(seq=3))  # done: nothing more is queued


def big_start(i: int) -> m.Start:
    """A Start of about 20 kB (a profile with long args): a few fill the stream's window."""
    spec = m.ShardSpec(shard_id=f"r-bbbbb.{i}", replica_id="r-bbbbb", model="x", profile="p", engine="sim",
                       port=20001, args=["x" * 20_000])
    return m.Start(spec=spec)


@asynccontextmanager
async def registered(capacity: int) -> Any:
    fleet = FleetService(NodeRegistry(1.0), ServerMetrics(lambda: {}), register_timeout=DEADLINE,
                         require_identity=False,
                         outbox_capacity=capacity)
    async with fleet_port(fleet.handle) as (_, url), dial(url, ssl_context=None, insecure=True,
                                                          max_message=MAX) as agent:
        await agent.send(m.encode(m.Register(node_id="gpu-01", version=__version__)))
        await until(lambda: "gpu-01" in fleet.links, "the node to register")
        yield fleet, agent


async def test_the_server_closes_the_stream_of_an_agent_that_stops_reading() -> None:
    capacity = 8
    async with registered(capacity) as (fleet, agent):
        session = fleet.links.get("gpu-01")
        assert session is not None
        sent = 0
        # The agent reads nothing: the writer fills the stream's window, then the outbox fills.
        while not session.outbox.overflow.is_set():
            session.send(big_start(sent))
            sent += 1
            await trio.testing.wait_all_tasks_blocked(cushion=0.001)
            assert sent <= capacity + 2 * MAX // 20_000 + 4, "the outbox grew past its bound"
        assert "slow consumer" in session.outbox.reason
        await until(lambda: "gpu-01" not in fleet.links, "the server to end the stream")
        node = fleet.registry.nodes["gpu-01"]
        assert not node.connected and "slow consumer" in node.reason
        # What was written before the end still reaches the agent, then the stream ends.
        with pytest.raises(ChannelClosed), trio.fail_after(DEADLINE):
            while True:
                await agent.receive()


async def test_an_agent_that_reads_never_overflows_the_server_outbox() -> None:
    capacity = 8
    async with registered(capacity) as (fleet, agent):
        session = fleet.links.get("gpu-01")
        assert session is not None
        got = []

        async def read() -> None:
            while True:
                got.append(m.decode_server_message(await agent.receive()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            for i in range(4 * capacity):
                session.send(big_start(i))
                await trio.testing.wait_all_tasks_blocked(cushion=0.001)
            await until(lambda: len(got) == 1 + 4 * capacity, "every Start to arrive")
            nursery.cancel_scope.cancel()
        assert not session.outbox.overflow.is_set() and "gpu-01" in fleet.links


class Stuck:
    """A server that answers the Register with a Welcome, then reads nothing more."""

    def __init__(self) -> None:
        self.connection = FakeConnection()
        self.received: list[Any] = []
        self._send, self._recv = trio.open_memory_channel[Any](math.inf)
        self._send.send_nowait(m.Welcome(server_version=__version__, heartbeat_interval=HEARTBEAT))

    async def send(self, payload: bytes) -> None:
        msg = m.decode_agent_message(payload)
        if self.received:
            await trio.sleep_forever()  # the window is full: this write never completes
        self.received.append(msg)

    async def receive(self) -> bytes:
        return m.encode(await self._recv.receive())


class Statuses:
    features: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self.send: Any = None

    def reports(self) -> list[m.ShardReport]:
        return []

    def snapshot(self) -> list[m.ShardReport]:
        return []

    async def handle(self, msg: Any, send: Any) -> None:
        pass

    def attach(self, send: Any) -> None:
        self.send = send


async def test_the_agent_drops_heartbeats_then_reconnects_when_a_status_cannot_be_queued(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def inline(fn: Any, *args: Any, **_: Any) -> Any:
        return fn(*args)

    monkeypatch.setattr(trio.to_thread, "run_sync", inline)
    caplog.set_level(logging.INFO, logger="llmgw.agent")
    capacity = 3
    engines = Statuses()
    stuck = Stuck()
    dialer = ScriptedDialer([stuck])
    agent = Agent(config(), hardware=NoHardware(), dialer=dialer, engines=engines, outbox_capacity=capacity)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(agent.run)
        await trio.sleep(HEARTBEAT * (capacity + 5))  # ok: virtual time (MockClock), heartbeats pile up
        assert agent.sessions == 1 and len(dialer.attempts) == 1  # dropping heartbeats ends nothing
        assert any("dropping heartbeats" in r.getMessage() for r in caplog.records)
        engines.send(STATUS)  # a status must not be dropped: the stream ends, the agent redials
        await dialer.exhausted.wait()
        nursery.cancel_scope.cancel()
    assert len(dialer.attempts) == 2
    assert any("slow consumer" in r.getMessage() and "ShardStatus" in r.getMessage() for r in caplog.records)
