"""Level-triggered resync: the agent lists its shards every `resync_every` heartbeats, and the
observe step heals what the server believes from it, without disowning what may still be in
flight on the stream. The end-to-end proof through a real agent and stream is
tests/e2e/test_fleet_resync.py."""

from __future__ import annotations

from typing import ClassVar

import trio
import trio.testing

from llmgw.catalog.load import parse_config
from llmgw.catalog.schema import AgentConfig
from llmgw.fleet.limits import Caps, heartbeat_problem
from llmgw.server.reconcile import Reconciler, StartShard
from llmgw.wire import messages as m
from tests.unit.test_agent_reconnect import HEARTBEAT, FakeStream, run_script
from tests.unit.test_reconcile import bring_up, catalog, make, nodes, starts, stops

NODE = "gpu-01"


def report(s: StartShard, state: str, **kw: object) -> m.ShardReport:
    return m.ShardReport(spec=s.spec, state=state, pid=7, endpoint=f"http://{NODE}:{s.spec.port}", **kw)  # type: ignore[arg-type]


def placed() -> tuple[Reconciler, StartShard]:
    rec = make(catalog(small=1, big=0))
    rec.on_register(NODE, [], 0, endpoint_host=NODE)
    [s] = starts(rec.reconcile(nodes(NODE), 0))
    return rec, s


def test_a_lost_ready_status_heals_from_the_next_resync() -> None:
    rec, s = placed()
    rec.on_shard_status(NODE, m.ShardStatus(shard_id=s.spec.shard_id, replica_id=s.spec.replica_id, state="starting"),
                        1)
    # The "ready" status is lost; the server still believes the engine is starting.
    [replica] = rec.replicas.values()
    assert replica.state == "starting"
    refused, changed = rec.on_resync(NODE, [report(s, "ready")], 2)
    assert refused == [] and changed
    assert replica.state == "ready" and replica.shards[0].endpoint == f"http://{NODE}:{s.spec.port}"
    # The next resync finds nothing new: no change, no reconcile pass.
    assert rec.on_resync(NODE, [report(s, "ready")], 3) == ([], False)


def test_a_shard_whose_start_may_be_in_flight_is_not_disowned() -> None:
    rec, _ = placed()
    assert rec.on_resync(NODE, [], 1) == ([], False)  # the agent has not seen the Start yet
    [replica] = rec.replicas.values()
    assert replica.state == "starting" and replica.shards[0].state == "starting"


def test_an_engine_the_agent_no_longer_lists_is_replaced_without_penalty() -> None:
    rec = make(catalog(small=1, big=0))
    [s] = bring_up(rec, nodes(NODE))
    refused, changed = rec.on_resync(NODE, [], 5)
    assert refused == [] and changed
    [replica] = rec.replicas.values()
    assert replica.state == "failed" and replica.failures == 0 and replica.next_attempt_at == 5
    assert replica.shards[0].state == "lost" and "its agent no longer lists it" in replica.reason
    [again] = starts(rec.reconcile(nodes(NODE), 5))
    assert again.spec.replica_id == s.spec.replica_id and again.spec.shard_id != s.spec.shard_id


def test_a_stop_in_flight_is_not_sent_twice() -> None:
    rec = make(catalog(small=1, big=0))
    [s] = bring_up(rec, nodes(NODE))
    rec.set_catalog(catalog(small=0, big=0))
    [stop] = stops(rec.reconcile(nodes(NODE), 1))
    assert stop.shard_id == s.spec.shard_id
    # The agent's list was taken before the Stop arrived: still ready. It stays stopping, the
    # Stop already on the stream is not repeated.
    assert rec.on_resync(NODE, [report(s, "ready")], 2) == ([], False)
    assert rec.reconcile(nodes(NODE), 3) == []
    # The agent stopped it and its status was lost: the next list, without it, lets it go.
    assert rec.on_resync(NODE, [], 4) == ([], True)
    assert rec.replicas == {}


def test_an_engine_the_server_does_not_know_is_adopted_and_an_old_end_is_not_news() -> None:
    rec, s = placed()
    rec.on_resync(NODE, [report(s, "starting")], 1)
    # An engine this server never placed (another server's, before a restart).
    foreign = StartShard(NODE, m.ShardSpec(shard_id="small-zzzzz.1", replica_id="small-zzzzz", model="small",
                                           profile="tp1", engine="sim", gpus=[3], port=20777))
    refused, changed = rec.on_resync(NODE, [report(s, "ready"), report(foreign, "ready")], 2)
    assert refused == [] and changed
    assert {r.adopted for r in rec.replicas.values()} == {False, True}
    rec.drain_log()
    # A finished engine the agent still lists is not adopted, and the resync says nothing of it
    # (it repeats every few heartbeats; the Register said it once).
    gone = m.ShardReport(spec=m.ShardSpec(shard_id="x-bbbbb.1", replica_id="x-bbbbb", model="small", profile="tp1",
                                          engine="sim", port=20001), state="exited")
    rec.on_resync(NODE, [report(s, "ready"), report(foreign, "ready"), gone], 3)
    assert not any("x-bbbbb" in line for line in rec.drain_log())


def test_an_exit_seen_by_a_resync_then_by_its_status_fails_the_replica_once() -> None:
    rec = make(catalog(small=1, big=0))
    [s] = bring_up(rec, nodes(NODE))
    rec.on_resync(NODE, [report(s, "exited", exit_code=1)], 1)
    rec.on_shard_status(NODE, m.ShardStatus(shard_id=s.spec.shard_id, replica_id=s.spec.replica_id, state="exited",
                                            exit_code=1), 1)
    [replica] = rec.replicas.values()
    assert replica.state == "failed" and replica.failures == 1


def test_a_heartbeat_listing_too_many_shards_is_refused() -> None:
    _, s = placed()
    beat = m.Heartbeat(seq=1, shards=[report(s, "ready")] * 3)
    assert heartbeat_problem(beat, Caps(shards=2)) is not None
    assert heartbeat_problem(beat, Caps(shards=3)) is None


def test_an_old_heartbeat_without_a_list_decodes_as_no_resync() -> None:
    old = b'{"type":"Heartbeat","seq":3,"ports":[],"gpus":[]}'
    msg = m.decode_agent_message(old)
    assert isinstance(msg, m.Heartbeat) and msg.shards is None
    assert b"shards" not in m.encode(m.Heartbeat(seq=1))  # and a heartbeat without one sends none


class ListedEngines:
    features: ClassVar[list[str]] = [m.FEATURE_START]

    def __init__(self) -> None:
        spec = m.ShardSpec(shard_id="r-bbbbb.1", replica_id="r-bbbbb", model="small", profile="tp1", engine="sim",
                           port=20001)
        self.runs = [m.ShardReport(spec=spec, state="ready")]
        self.forgot = 0

    def reports(self) -> list[m.ShardReport]:
        self.forgot += 1
        return list(self.runs)

    def snapshot(self) -> list[m.ShardReport]:
        return list(self.runs)

    async def handle(self, msg: object, send: object) -> None:
        pass

    def attach(self, send: object) -> None:
        pass


async def test_the_agent_lists_its_shards_every_resync_every_heartbeats(autojump_clock: trio.testing.MockClock) -> None:
    cfg = parse_config(f"server: http://127.0.0.1:1\nnode_id: {NODE}\nheartbeat_interval: {HEARTBEAT}s\nresync_every: "
                       "3\n",
                       AgentConfig)
    engines = ListedEngines()
    stream = FakeStream(heartbeats=7)
    await run_script([stream], engines=engines, cfg=cfg)
    beats = [x for x in stream.received if isinstance(x, m.Heartbeat)]
    assert [h.shards is not None for h in beats] == [False, False, True, False, False, True, False]
    assert all(h.shards == engines.runs for h in beats if h.shards is not None)
    assert engines.forgot == 1  # only the Register's list forgets finished shards


async def test_resync_every_zero_never_lists(autojump_clock: trio.testing.MockClock) -> None:
    cfg = parse_config(f"server: http://127.0.0.1:1\nnode_id: {NODE}\nheartbeat_interval: {HEARTBEAT}s\nresync_every: "
                       "0\n",
                       AgentConfig)
    stream = FakeStream(heartbeats=7)
    await run_script([stream], engines=ListedEngines(), cfg=cfg)
    assert all(x.shards is None for x in stream.received if isinstance(x, m.Heartbeat))
