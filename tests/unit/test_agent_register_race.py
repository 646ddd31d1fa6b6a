"""A shard's state change between the agent's Register snapshot and the server's Welcome is
not lost: the supervisor is attached before the Register, so the change follows as a ShardStatus."""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

import trio

from llmgw import __version__
from llmgw.agent.agent import Agent
from llmgw.agent.supervisor import ShardRun, Supervisor
from llmgw.catalog.load import parse_config
from llmgw.catalog.schema import AgentConfig
from llmgw.wire import messages as m
from llmgw.wire.shardstate import ShardState
from tests.unit.fakes import NoHardware


class _Conn:
    last_received = 0.0

    def ping(self) -> None:
        pass


class _Channel:
    """A stream whose engine turns ready between the Register and the Welcome."""

    def __init__(self, sup: Supervisor, run: ShardRun) -> None:
        self.sent: list[object] = []
        self.sup, self.run = sup, run
        self.tx, self.rx = trio.open_memory_channel[bytes](10)
        self.connection = _Conn()

    async def send(self, payload: bytes) -> None:
        msg = m.decode_agent_message(payload)
        self.sent.append(msg)
        if isinstance(msg, m.Register):
            self.run.state = ShardState.READY
            self.sup._emit(self.run)
            await self.tx.send(m.encode(m.Welcome(server_version=__version__, heartbeat_interval=1.0)))

    async def receive(self) -> bytes:
        return await self.rx.receive()


async def test_a_change_between_register_and_welcome_reaches_the_server(tmp_path: Path) -> None:
    cfg = parse_config("server: http://127.0.0.1:1\nnode_id: gpu-01\n", AgentConfig)
    sup = Supervisor(str(tmp_path))
    spec = m.ShardSpec(shard_id="r.1", replica_id="r", model="x", profile="p", engine="sim", gpus=[0], port=20001)
    run = ShardRun(spec, "/dev/null", "http://127.0.0.1:20001")
    sup.runs["r.1"] = run
    chan = _Channel(sup, run)

    @asynccontextmanager
    async def dialer():  # type: ignore[no-untyped-def]
        yield chan

    agent = Agent(cfg, hardware=NoHardware(), dialer=dialer, engines=sup)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(agent.run)
        with trio.fail_after(10):
            while not any(isinstance(s, m.ShardStatus) for s in chan.sent):  # noqa: ASYNC110
                await trio.sleep(0.01)  # ok: poll interval of a deadline-bounded wait
        nursery.cancel_scope.cancel()
    register = chan.sent[0]
    assert isinstance(register, m.Register) and register.shards[0].state == "starting"
    assert [s.state for s in chan.sent if isinstance(s, m.ShardStatus)] == ["ready"], chan.sent
