"""Regression tests for bugs a review found: a state change lost during a reconnect, IPv6
endpoints, a reconcile loop spinning on a past deadline, an adopted engine making a stopping
one's GPUs look free, a health check overriding a Stop."""

from __future__ import annotations

import random
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from llmgw import __version__
from llmgw.agent.agent import Agent
from llmgw.agent.supervisor import ShardRun, Supervisor, _connect_host
from llmgw.catalog.load import parse_config
from llmgw.catalog.schema import AgentConfig, GatewaySettings, Model, Profile, StaticEndpoint
from llmgw.server.gateway.proxy import Gateway
from llmgw.server.metrics import GatewayMetrics, ServerMetrics
from llmgw.server.reconcile import NodeInfo, Reconciler, Settings, StartShard, StopShard
from llmgw.web.client import Upstream
from llmgw.wire import messages as m
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
            self.run.state = "ready"
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


def test_ipv6_hosts_are_bracketed() -> None:
    assert _connect_host("::") == "[::1]" and _connect_host("fd00::1") == "[fd00::1]" and _connect_host("0.0.0.0") == "127.0.0.1"
    up = Upstream("http://[fd00::1]:20001")
    assert up.host == "fd00::1" and up.port == 20001 and up.authority == b"[fd00::1]:20001"


async def test_gateway_leaves_an_unusable_endpoint_out_of_rotation() -> None:
    gw = Gateway(GatewaySettings(), GatewayMetrics(ServerMetrics(lambda: {}).registry, lambda: None),
                 client_door=lambda request: True)
    gw.configure([Model(name="chat")], [StaticEndpoint(model="chat", url="http://127.0.0.1:9")])
    gw.set_endpoints({"chat": {"http://fd00::1:20001", "http://127.0.0.1:20002"}})  # the first is not a URL
    assert sorted(gw.routes["chat"].balancer.endpoints) == ["http://127.0.0.1:20002", "http://127.0.0.1:9"]


def _gpus() -> list[m.Gpu]:
    return [m.Gpu(index=i, name="H100", memory_mib=81559) for i in range(4)]


def _rec() -> Reconciler:
    return Reconciler([Model(name="small", replicas=1, profiles=[Profile(engine="sim", gpus=1)])],
                      Settings(backoff_initial=2, backoff_max=60, port_range=(20000, 20999)), random.Random(3))


FEATURES = [m.FEATURE_START, m.FEATURE_STOP]


def test_no_deadline_for_a_failed_replica_whose_engine_is_still_stopping() -> None:
    rec = _rec()
    fleet = [NodeInfo(node_id="n1", state="ready", gpus=_gpus(), features=FEATURES)]
    [start] = [a for a in rec.reconcile(fleet, 0) if isinstance(a, StartShard)]
    rec.on_shard_status("n1", m.ShardStatus(shard_id=start.spec.shard_id, replica_id=start.spec.replica_id, state="ready"), 0)
    rec.on_shard_status("n1", m.ShardStatus(shard_id=start.spec.shard_id, replica_id=start.spec.replica_id, state="stopping"), 1)
    assert next(iter(rec.replicas.values())).state == "failed"
    assert rec.next_deadline() is None  # the "stopped" status wakes the loop, not a past deadline


def test_adopting_a_replica_while_its_failed_twin_is_still_stopping_keeps_both() -> None:
    rec = _rec()
    n1 = NodeInfo(node_id="n1", state="ready", gpus=_gpus(), features=FEATURES)
    n2 = NodeInfo(node_id="n2", state="ready", gpus=_gpus(), features=FEATURES)
    [first] = [a for a in rec.reconcile([n2], 0) if isinstance(a, StartShard)]
    rec.on_shard_status("n2", m.ShardStatus(shard_id=first.spec.shard_id, replica_id=first.spec.replica_id, state="ready"), 0)
    rec.on_node_state("n2", "lost", 10)
    [second] = [a for a in rec.reconcile([n1], 10) if isinstance(a, StartShard)]
    rec.on_shard_status("n1", m.ShardStatus(shard_id=second.spec.shard_id, replica_id=second.spec.replica_id, state="ready"), 11)
    rec.on_shard_status("n1", m.ShardStatus(shard_id=second.spec.shard_id, replica_id=second.spec.replica_id, state="stopping"), 12)
    rec.on_register("n2", [m.ShardReport(spec=first.spec, state="ready", pid=5)], 13)
    shards = {s.shard_id: s.state for r in rec.replicas.values() for s in r.shards}
    assert shards[second.spec.shard_id] == "stopping"  # still tracked: its GPU is not free
    assert shards[first.spec.shard_id] == "ready"
    actions = rec.reconcile([n1, n2], 13)
    assert second.spec.shard_id in [a.shard_id for a in actions if isinstance(a, StopShard)]
    assert not [a for a in actions if isinstance(a, StartShard)]


def test_an_unhealthy_shard_keeps_its_gpus_and_its_replica_ready_with_the_reason() -> None:
    """Issue 9: agents report a hung engine `unhealthy`; the replica stays (the gateway's own
    health checks take the endpoint out of rotation) and its GPUs stay taken."""
    rec = _rec()
    fleet = [NodeInfo(node_id="n1", state="ready", gpus=_gpus(), features=FEATURES)]
    [start] = [a for a in rec.reconcile(fleet, 0) if isinstance(a, StartShard)]
    sid, rid = start.spec.shard_id, start.spec.replica_id
    rec.on_shard_status("n1", m.ShardStatus(shard_id=sid, replica_id=rid, state="ready"), 1)
    rec.on_shard_status("n1", m.ShardStatus(shard_id=sid, replica_id=rid, state="unhealthy", reason="unhealthy since T"), 2)
    replica = rec.replicas[rid]
    assert replica.state == "ready" and replica.reason == "n1: unhealthy since T"
    assert not [a for a in rec.reconcile(fleet, 3) if isinstance(a, StartShard)]  # nothing placed twice
    rec.on_shard_status("n1", m.ShardStatus(shard_id=sid, replica_id=rid, state="ready"), 4)
    assert replica.state == "ready" and replica.reason == ""
