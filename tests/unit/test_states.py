"""The shard and replica state machines: one test per illegal transition, each refused (the state
stays) and recorded for the log; the paths a node's message takes refuse them too, and the
driver logs them as warnings."""

from __future__ import annotations

import logging

import pytest
import trio

from llmgw.catalog.schema import ReconcileSettings
from llmgw.server.control import Controller, Settle, make_reconciler
from llmgw.server.links import FleetLinks
from llmgw.server.reconcile import Reconciler, Replica, Shard
from llmgw.server.registry import NodeRegistry
from llmgw.server.states import (
    ENDED,
    GONE,
    HOLDING,
    REPLICA_TRANSITIONS,
    SERVING,
    SHARD_TRANSITIONS,
    ReplicaState,
    ShardState,
)
from llmgw.wire import messages as m
from tests.unit.test_reconcile import bring_up, catalog, make, nodes, starts

ILLEGAL_SHARD = [(old, new) for old in ShardState for new in ShardState
                 if new != old and new not in SHARD_TRANSITIONS[old]]
ILLEGAL_REPLICA = [(old, new) for old in ReplicaState for new in ReplicaState
                   if new != old and new not in REPLICA_TRANSITIONS[old]]


def test_the_tables_agree_with_the_state_sets() -> None:
    assert all(not SHARD_TRANSITIONS[s] for s in ENDED)  # an attempt that ended stays ended
    assert SERVING <= HOLDING and not HOLDING & GONE and set(ShardState) == HOLDING | GONE
    assert not REPLICA_TRANSITIONS[ReplicaState.STOPPING]
    # The walk below has something to walk: each machine refuses some changes.
    assert len(ILLEGAL_SHARD) >= 20 and len(ILLEGAL_REPLICA) >= 5


@pytest.mark.parametrize(("old", "new"), ILLEGAL_SHARD, ids=lambda s: str(s))
def test_illegal_shard_transition_is_refused_and_recorded(old: ShardState, new: ShardState) -> None:
    rec = make(catalog(small=0, big=0))
    shard = Shard(shard_id="r.1", node="gpu-01", state=old)
    assert rec._shard_to(shard, new, "a test") is False
    assert shard.state == old
    [illegal] = rec.drain_illegal()
    assert (illegal.kind, illegal.id, illegal.old, illegal.new) == ("shard", "r.1", old, new)
    assert f"{old} → {new}" in illegal.line() and f"it stays {old}" in illegal.line()


@pytest.mark.parametrize(("old", "new"), ILLEGAL_REPLICA, ids=lambda s: str(s))
def test_illegal_replica_transition_is_refused_and_recorded(old: ReplicaState, new: ReplicaState) -> None:
    rec = make(catalog(small=0, big=0))
    replica = Replica(id="r", model="small", state=old, created_at=0.0, state_since=0.0, reason="before")
    assert rec._replica_to(replica, new, 5.0, "after", "a test") is False
    assert (replica.state, replica.state_since, replica.reason) == (old, 0.0, "before")
    [illegal] = rec.drain_illegal()
    assert (illegal.kind, illegal.id, illegal.old, illegal.new) == ("replica", "r", old, new)


def test_every_legal_transition_is_taken() -> None:
    rec = make(catalog(small=0, big=0))
    for old, targets in SHARD_TRANSITIONS.items():
        for new in targets:
            shard = Shard(shard_id="r.1", node="gpu-01", state=old)
            assert rec._shard_to(shard, new, "a test") and shard.state == new
    for rold, rtargets in REPLICA_TRANSITIONS.items():
        for rnew in rtargets:
            replica = Replica(id="r", model="small", state=rold, created_at=0.0, state_since=0.0)
            assert rec._replica_to(replica, rnew, 5.0, "", "a test") and replica.state == rnew
            assert replica.state_since == 5.0
    assert rec.drain_illegal() == []


def _one_ready() -> tuple[Reconciler, Replica]:
    rec = make(catalog(small=1, big=0))
    bring_up(rec, nodes("gpu-01"))
    [replica] = rec.replicas.values()
    assert replica.state == "ready"
    return rec, replica


def test_a_status_after_the_engine_exited_is_refused() -> None:
    rec, replica = _one_ready()
    shard = replica.shards[0]
    rec.on_shard_status("gpu-01",
                        m.ShardStatus(shard_id=shard.shard_id, replica_id=replica.id, state="exited", exit_code=1), 1)
    assert shard.state == "exited" and replica.state == "failed" and replica.failures == 1
    rec.on_shard_status("gpu-01", m.ShardStatus(shard_id=shard.shard_id, replica_id=replica.id, state="ready"), 2)
    assert shard.state == "exited" and replica.state == "failed"
    [illegal] = rec.drain_illegal()
    assert (illegal.old, illegal.new) == ("exited", "ready") and "ShardStatus from gpu-01" in illegal.cause
    # The same end told twice (a status and a resync of one exit) is no second failure.
    rec.on_shard_status("gpu-01",
                        m.ShardStatus(shard_id=shard.shard_id, replica_id=replica.id, state="exited", exit_code=1), 3)
    assert replica.failures == 1 and rec.drain_illegal() == []


def test_an_unknown_state_from_a_node_is_refused() -> None:
    rec, replica = _one_ready()
    shard = replica.shards[0]
    rec.on_shard_status("gpu-01", m.ShardStatus(shard_id=shard.shard_id, replica_id=replica.id, state="dancing"), 1)
    assert shard.state == "ready" and replica.state == "ready"
    [illegal] = rec.drain_illegal()
    assert illegal.new == "dancing" and "unknown state" in illegal.cause


def test_a_served_engine_reported_starting_again_is_refused() -> None:
    rec, replica = _one_ready()
    shard = replica.shards[0]
    assert shard.spec is not None
    rec.on_register("gpu-01", [m.ShardReport(spec=shard.spec, state="starting")], 1, endpoint_host="gpu-01")
    assert shard.state == "ready" and replica.state == "ready"
    [illegal] = rec.drain_illegal()
    assert (illegal.old, illegal.new) == ("ready", "starting") and "Register from gpu-01" in illegal.cause


async def test_the_driver_logs_a_refused_transition_as_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="llmgw.server.reconcile")
    registry = NodeRegistry(1.0)
    controller = Controller(make_reconciler(catalog(small=1, big=0), ReconcileSettings()), registry,
                            settle=Settle(ReconcileSettings(), registry), links=FleetLinks())
    [start] = starts(controller.reconciler.reconcile(nodes("gpu-01"), trio.current_time()))
    status = m.ShardStatus(shard_id=start.spec.shard_id, replica_id=start.spec.replica_id, state="stopped")
    controller.shard_status("gpu-01", status)
    controller.shard_status("gpu-01", m.ShardStatus(shard_id=start.spec.shard_id, replica_id=start.spec.replica_id,
                                                    state="ready\x1b[2J"))
    [line] = [r.getMessage() for r in caplog.records if "not a legal transition" in r.getMessage()]
    assert start.spec.shard_id in line and "stopped → ready" in line and "\x1b" not in line
