"""A node acts only on its own shards (issue 19), decided by the pure reconciler.

The table below has one row per agent->server message kind that names a shard; a test walks
the wire's message types and fails when one that names a shard has no row, so a new kind
cannot arrive without its ownership check.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from llmgw.agent.supervisor import Supervisor
from llmgw.server.admit import decide_endpoint_host
from llmgw.server.reconcile import (
    REFUSED_ENDPOINT,
    REFUSED_FOREIGN,
    Reconciler,
    Refusal,
    StartShard,
)
from llmgw.wire import messages as m
from tests.unit.test_reconcile import bring_up, catalog, make, nodes, starts, stops

OWNER, THIEF = "gpu-01", "gpu-03"

Send = Callable[[Reconciler, str, StartShard, str], list[Refusal]]


def _register(rec: Reconciler, node: str, s: StartShard, endpoint: str) -> list[Refusal]:
    report = m.ShardReport(spec=s.spec, state="failed", pid=4242, started_at=1.0, endpoint=endpoint, reason="forged")
    return rec.on_register(node, [report], 5, wall_now=1_000_000.0, endpoint_host=node)


def _status(rec: Reconciler, node: str, s: StartShard, endpoint: str) -> list[Refusal]:
    msg = m.ShardStatus(shard_id=s.spec.shard_id, replica_id=s.spec.replica_id, state="failed", pid=4242,
                        endpoint=endpoint)
    return rec.on_shard_status(node, msg, 5)


def _progress(rec: Reconciler, node: str, s: StartShard, endpoint: str) -> list[Refusal]:
    return rec.on_progress(node, m.Progress(shard_id=s.spec.shard_id, source="hf", done_bytes=1, total_bytes=2), 5)


def _resync(rec: Reconciler, node: str, s: StartShard, endpoint: str) -> list[Refusal]:
    report = m.ShardReport(spec=s.spec, state="failed", pid=4242, started_at=1.0, endpoint=endpoint, reason="forged")
    refused, _ = rec.on_resync(node, [report], 5, wall_now=1_000_000.0)
    return refused


# One row per agent->server message kind that names a shard: how that kind reaches the reconciler.
DOORS: dict[type, Send] = {m.Register: _register, m.ShardStatus: _status, m.Progress: _progress, m.Heartbeat: _resync}


def _mentions(tp: object, target: type) -> bool:
    return tp is target or any(_mentions(arg, target) for arg in typing.get_args(tp))


def names_a_shard(kind: type) -> bool:
    hints = typing.get_type_hints(kind)
    return "shard_id" in hints or any(_mentions(tp, m.ShardReport) or _mentions(tp, m.ShardSpec)
                                      for tp in hints.values())


def test_every_agent_message_that_names_a_shard_has_an_ownership_row() -> None:
    kinds = typing.get_args(m.AgentMessage)
    naming = {k for k in kinds if names_a_shard(k)}
    assert {m.Register, m.ShardStatus, m.Progress} <= naming  # the walk itself works
    missing = sorted(k.__name__ for k in naming - DOORS.keys())
    assert not missing, f"agent messages naming a shard without an ownership check in the reconciler: {missing}"


def snapshot(rec: Reconciler) -> bytes:
    return msgspec.json.encode(sorted(rec.replicas.values(), key=lambda r: r.id))


@pytest.mark.parametrize("kind", list(DOORS), ids=lambda k: k.__name__)
def test_a_node_cannot_touch_another_nodes_shard(kind: type) -> None:
    rec = make(catalog(small=1, big=0))
    fleet = nodes(OWNER, THIEF)
    [s] = bring_up(rec, fleet[:1])  # placed on gpu-01 while it is the only node
    before = snapshot(rec)
    forged = f"http://{THIEF}:{s.spec.port}"
    [refusal] = DOORS[kind](rec, THIEF, s, forged)
    assert refusal.reason == REFUSED_FOREIGN and refusal.kind == kind.__name__
    assert OWNER in refusal.detail and THIEF in refusal.detail and s.spec.shard_id in refusal.detail
    assert snapshot(rec) == before  # nothing changed: state, endpoint, node, pid
    [replica] = rec.replicas.values()
    assert replica.state == "ready" and replica.shards[0].endpoint == f"http://{OWNER}:{s.spec.port}"
    assert rec.reconcile(fleet, 6) == []  # and nothing to do about it


def test_own_shard_with_an_endpoint_on_another_host_is_refused() -> None:
    rec = make(catalog(small=1, big=0))
    fleet = nodes(OWNER)
    [s] = starts(rec.reconcile(fleet, 0))
    elsewhere = f"http://10.9.9.9:{s.spec.port}"
    for door in (_status, _register):
        [refusal] = door(rec, OWNER, s, elsewhere)
        assert refusal.reason == REFUSED_ENDPOINT and "10.9.9.9" in refusal.detail
    [replica] = rec.replicas.values()
    assert replica.state == "starting" and replica.shards[0].endpoint == ""
    # The same port on the node's own host: accepted.
    assert rec.on_shard_status(OWNER, m.ShardStatus(shard_id=s.spec.shard_id, replica_id=s.spec.replica_id,
                                                    state="ready",
                                                    endpoint=f"http://{OWNER}:{s.spec.port}"), 1) == []
    assert replica.state == "ready" and replica.shards[0].endpoint == f"http://{OWNER}:{s.spec.port}"


def test_adoption_outside_the_port_range_or_on_another_host_is_refused() -> None:
    rec = make(catalog(small=1, big=0))
    spec = m.ShardSpec(shard_id="small-zzzzz.1", replica_id="small-zzzzz", model="small", profile="tp1", engine="sim",
                       gpus=[0], port=20001)
    wrong_host = m.ShardReport(spec=spec, state="ready", endpoint="http://10.9.9.9:20001")
    out_of_range = m.ShardReport(spec=msgspec.structs.replace(spec, port=8080), state="ready", endpoint=f"http://{OWNER}:8080")
    refused = rec.on_register(OWNER, [wrong_host, out_of_range], 0, endpoint_host=OWNER)
    assert [r.reason for r in refused] == [REFUSED_ENDPOINT, REFUSED_ENDPOINT]
    assert "outside the port range" in refused[1].detail
    assert rec.replicas == {}
    # Derived, not reported: the adopted shard's endpoint is the node's host and the spec's port.
    assert rec.on_register(OWNER, [m.ShardReport(spec=spec, state="ready", endpoint=f"http://{OWNER}:20001")], 1,
                           endpoint_host=OWNER) == []
    assert rec.replicas["small-zzzzz"].shards[0].endpoint == f"http://{OWNER}:20001"


def test_a_reused_replica_id_with_an_old_start_time_does_not_displace_the_legitimate_replica() -> None:
    rec = make(catalog(small=1, big=0))
    fleet = nodes(OWNER, THIEF)
    [s] = bring_up(rec, fleet[:1], now=100)
    legit = rec.replicas[s.spec.replica_id]
    # gpu-03 reports an engine of its own that claims gpu-01's replica id and a start in 1970.
    spec = m.ShardSpec(shard_id="evil.1", replica_id=legit.id, model="small", profile="tp1", engine="sim", gpus=[0],
                       port=20500)
    report = m.ShardReport(spec=spec, state="ready", pid=7, started_at=1.0, endpoint=f"http://{THIEF}:20500")
    assert rec.on_register(THIEF, [report], 200, wall_now=2_000_000_000.0, endpoint_host=THIEF) == []
    assert rec.replicas[legit.id] is legit  # never superseded, never renamed
    adopted = next(r for r in rec.replicas.values() if r is not legit)
    assert adopted.shards[0].node == THIEF and adopted.id != legit.id
    # One too many: the surplus rule stops the one this server saw last, whatever it claims.
    [stop] = stops(rec.reconcile(fleet, 201))
    assert (stop.node, stop.shard_id) == (THIEF, "evil.1")
    assert legit.state == "ready" and legit.shards[0].endpoint == f"http://{OWNER}:{s.spec.port}"


def test_a_failed_replica_of_another_node_is_not_superseded_by_a_report() -> None:
    rec = make(catalog(small=1, big=0))
    [s] = bring_up(rec, nodes(OWNER))
    assert rec.on_shard_status(OWNER, m.ShardStatus(shard_id=s.spec.shard_id, replica_id=s.spec.replica_id,
                                                    state="exited"), 1) == []
    legit = rec.replicas[s.spec.replica_id]
    assert legit.state == "failed"
    spec = m.ShardSpec(shard_id="evil.1", replica_id=legit.id, model="small", profile="tp1", engine="sim", gpus=[0],
                       port=20500)
    rec.on_register(THIEF, [m.ShardReport(spec=spec, state="ready", endpoint=f"http://{THIEF}:20500")], 2,
                    endpoint_host=THIEF)
    assert rec.replicas[legit.id] is legit and legit.state == "failed"
    assert any(r.shards[0].shard_id == "evil.1" and r.id != legit.id for r in rec.replicas.values())


def test_endpoint_host_advertised_or_peer() -> None:
    assert decide_endpoint_host("advertised", "10.0.0.21", "10.0.0.99") == ("10.0.0.21", "")
    assert decide_endpoint_host("advertised", "", "10.0.0.99") == ("10.0.0.99", "")  # an older agent says nothing
    assert decide_endpoint_host("advertised", "gpu-01.example.com", "10.0.0.99") == ("gpu-01.example.com", "")
    assert decide_endpoint_host("peer", "", "10.0.0.99") == ("10.0.0.99", "")
    assert decide_endpoint_host("peer", "10.0.0.99", "10.0.0.99") == ("10.0.0.99", "")
    host, why = decide_endpoint_host("peer", "10.0.0.5", "10.0.0.99")
    assert host == "" and "10.0.0.5" in why and "10.0.0.99" in why
    for bad in ("evil.com/x", "a b", "h\nINFO forged", "10.0.0.1:80", "-x"):
        host, why = decide_endpoint_host("advertised", bad, "10.0.0.99")
        assert host == "" and "\n" not in why, bad


def test_a_reused_replica_id_never_displaces_a_replica_that_is_still_starting() -> None:
    rec = make(catalog(small=1, big=0))
    fleet = nodes(OWNER, THIEF)
    [s] = starts(rec.reconcile(fleet[:1], 100))  # placed on gpu-01, still starting
    legit = rec.replicas[s.spec.replica_id]
    spec = m.ShardSpec(shard_id="evil.1", replica_id=legit.id, model="small", profile="tp1", engine="sim", gpus=[0],
                       port=20500)
    report = m.ShardReport(spec=spec, state="ready", pid=7, started_at=1.0, endpoint=f"http://{THIEF}:20500")
    assert rec.on_register(THIEF, [report], 200, wall_now=2_000_000_000.0, endpoint_host=THIEF) == []
    [stop] = stops(rec.reconcile(fleet, 201))
    assert (stop.node, stop.shard_id) == (THIEF, "evil.1")
    assert legit.state == "starting" and rec.replicas[legit.id] is legit


async def test_the_server_sends_a_node_requests_only_for_its_own_shards() -> None:
    from llmgw.catalog.schema import ReconcileSettings
    from llmgw.server.control import Controller, Settle, make_reconciler
    from llmgw.server.fleet_service import Session
    from llmgw.server.links import FleetLinks
    from llmgw.server.reconcile import StopShard
    from llmgw.server.registry import NodeRegistry

    registry = NodeRegistry(1.0)
    sessions = {n: Session(n, i, None, [m.FEATURE_START, m.FEATURE_STOP]) for i, n in enumerate((OWNER, THIEF))}  # type: ignore[arg-type]
    links = FleetLinks[Session]()
    for n, session in sessions.items():
        links.add(n, session)
    controller = Controller(make_reconciler(catalog(small=1, big=0), ReconcileSettings()), registry,
                            settle=Settle(ReconcileSettings(), registry), links=links)
    [s] = bring_up(controller.reconciler, nodes(OWNER))
    controller._send(StopShard(THIEF, s.spec.shard_id, 1.0, "a decision that mixed nodes up"))
    controller._send(StartShard(THIEF, s.spec))
    assert sessions[THIEF].outbox.take_queued() == []
    controller._send(StopShard(OWNER, s.spec.shard_id, 1.0, "surplus"))
    assert [m.decode_server_message(p) for p in sessions[OWNER].outbox.take_queued()] == (
        [m.Stop(shard_id=s.spec.shard_id, grace=1.0, reason="surplus")])


async def test_the_agent_refuses_a_stop_or_drain_for_a_shard_it_does_not_run(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    from tests.unit.test_fleet_ids import files, supervised

    caplog.set_level(logging.INFO)

    async def body(supervisor: Supervisor, sent: list[Any]) -> None:
        before = files(tmp_path)
        await supervisor.handle(m.Stop(shard_id="small-other.1", reason="for gpu-02"), sent.append)
        await supervisor.handle(m.Drain(shard_id="small-other.1"), sent.append)
        assert files(tmp_path) == before and supervisor.runs == {}
        # The only answer: "not here", so the server can let it go.
        assert sent == [m.ShardStatus(shard_id="small-other.1", replica_id="", state="stopped",
                                      reason="not running here")]

    await supervised(tmp_path / "work", body)
    refusals = [r.getMessage() for r in caplog.records if "refusing" in r.getMessage()]
    assert len(refusals) == 2 and all("does not run on this node" in line for line in refusals)
