"""The move primitive's decisions (moves.py) on a fake clock: a successor first, the old one
out of rotation, then drained; one surge per model; no room; a successor that fails."""

from __future__ import annotations

import msgspec

from llmgw.catalog.schema import Model, Profile
from llmgw.server.moves import Move, NoRoom
from llmgw.server.reconcile import AVOIDED, Reconciler, StartShard
from llmgw.server.states import MOVE_TRANSITIONS, MoveState, ReplicaState, move_may
from llmgw.wire import messages as m
from tests.unit.test_reconcile import bring_up, make, nodes, starts, status, stops


def small(n: int, gpus: int = 1) -> list[Model]:
    return [Model(name="small", replicas=n, profiles=[Profile(name="tp1", engine="sim", gpus=gpus)])]


def ready(rec: Reconciler, placed: list[StartShard], now: float = 0) -> None:
    for s in placed:
        status(rec, s, "ready", endpoint=f"http://{s.node}:{s.spec.port}")


def serving(rec: Reconciler) -> set[str]:
    """What the gateway would route to: ready replicas (views.ready_endpoints)."""
    return {r.id for r in rec.replicas.values() if r.state == ReplicaState.READY}


def test_the_table_is_whole_and_ends_are_final() -> None:
    assert set(MOVE_TRANSITIONS) == set(MoveState)
    assert not MOVE_TRANSITIONS[MoveState.DONE] and not MOVE_TRANSITIONS[MoveState.FAILED]
    assert not move_may(MoveState.RETIRING, MoveState.FAILED)  # the successor serves: nothing to undo


def test_a_move_surges_then_retires_the_old_one_through_rotation_then_drain() -> None:
    rec = make(small(1))
    fleet = nodes("gpu-01", "gpu-02")
    [first] = bring_up(rec, nodes("gpu-01"))
    old = first.spec.replica_id
    move = rec.request_move(old, 1, reason="drain of gpu-01", kind="drain", avoid=["gpu-01"])
    assert isinstance(move, Move) and move.state == MoveState.QUEUED
    [succ_start] = starts(rec.reconcile(fleet, 2))
    assert succ_start.node == "gpu-02" and move.state == MoveState.SURGING
    successor = succ_start.spec.replica_id
    assert rec.replicas[successor].replaces == old
    # Starting successor: the old one serves alone, nothing is stopped, no third replica is made.
    assert rec.reconcile(fleet, 3) == [] and serving(rec) == {old} and len(rec.replicas) == 2
    ready(rec, [succ_start])
    # Ready: the old one leaves rotation first (draining), no Stop or Drain yet.
    assert stops(rec.reconcile(fleet, 4)) == []
    assert rec.replicas[old].state == ReplicaState.DRAINING and serving(rec) == {successor}
    assert move.state == MoveState.RETIRING
    # Only after the gateway synced: Drain with the profile's grace.
    assert rec.rotation_synced() is True and rec.rotation_synced() is False
    [drain] = stops(rec.reconcile(fleet, 5))
    assert drain.drain and drain.shard_id == first.spec.shard_id and drain.node == "gpu-01"
    rec.on_shard_status("gpu-01", m.ShardStatus(
        shard_id=first.spec.shard_id, replica_id=old, state="stopped"), 6)
    rec.reconcile(fleet, 7)
    assert move.state == MoveState.DONE and set(rec.replicas) == {successor}
    assert rec.replicas[successor].replaces == ""
    kinds = [(n.kind, n.message) for n in rec.drain_notes()]
    assert all(k == "drain" for k, _ in kinds) and any("done" in msg for _, msg in kinds), kinds


def test_one_surge_per_model_at_a_time() -> None:
    rec = make(small(2))
    fleet = nodes("gpu-01", "gpu-02", "gpu-03")
    placed = bring_up(rec, nodes("gpu-01"))
    a, b = (s.spec.replica_id for s in placed)
    ma = rec.request_move(a, 1, reason="r", avoid=["gpu-01"])
    mb = rec.request_move(b, 1, reason="r", avoid=["gpu-01"])
    assert isinstance(ma, Move) and isinstance(mb, Move)
    first = starts(rec.reconcile(fleet, 2))
    assert len(first) == 1 and ma.state == MoveState.SURGING and mb.state == MoveState.QUEUED
    assert mb.note == f"waiting for the move of {a} to finish (one per model at a time)"  # what ctl drain prints
    table = rec.unfinished_by_replica()  # the listing's one walk agrees with move_of for every replica
    assert {rid: table.get(rid) for rid in rec.replicas} == {rid: rec.move_of(rid) for rid in rec.replicas}
    assert table[a] is ma and table[b] is mb and table[ma.successor] is ma
    assert isinstance(rec.request_move(a, 2, reason="again"), str)  # already being moved
    ready(rec, first)
    rec.reconcile(fleet, 3)
    rec.rotation_synced()
    rec.reconcile(fleet, 4)
    rec.on_shard_status("gpu-01", m.ShardStatus(
        shard_id=placed[0].spec.shard_id, replica_id=a, state="stopped"), 5)
    second = starts(rec.reconcile(fleet, 6))
    assert ma.state == MoveState.DONE and mb.state == MoveState.SURGING and len(second) == 1
    assert second[0].node != "gpu-01"


def test_no_room_fails_the_move_and_stops_nothing() -> None:
    rec = make(small(1, gpus=8))
    fleet = nodes("gpu-01", "gpu-02")
    placed = bring_up(rec, fleet)
    old = placed[0].spec.replica_id
    other = "gpu-02" if placed[0].node == "gpu-01" else "gpu-01"
    # The other node takes no new placements (cordoned).
    fleet = [msgspec.structs.replace(n, cordoned=n.node_id == other) for n in fleet]
    move = rec.request_move(old, 1, reason="drain", avoid=[placed[0].node])
    assert isinstance(move, Move)
    actions = rec.reconcile(fleet, 2)
    assert actions == [] and move.state == MoveState.FAILED
    assert "no room" in move.note and f"{other}: cordoned" in move.note and AVOIDED in move.note, move.note
    assert set(rec.replicas) == {old} and serving(rec) == {old}


def test_no_room_below_retires_the_old_one_first() -> None:
    rec = make(small(1, gpus=8))
    fleet = nodes("gpu-01")
    [first] = bring_up(rec, fleet)
    old = first.spec.replica_id
    move = rec.request_move(old, 1, reason="rollout", kind="rollout", no_room=NoRoom.BELOW)
    assert isinstance(move, Move)
    rec.reconcile(fleet, 2)
    assert move.state == MoveState.BELOW and rec.replicas[old].state == ReplicaState.DRAINING
    rec.rotation_synced()
    [drain] = stops(rec.reconcile(fleet, 3))
    assert drain.drain
    rec.on_shard_status("gpu-01", m.ShardStatus(
        shard_id=first.spec.shard_id, replica_id=old, state="stopped"), 4)
    [again] = starts(rec.reconcile(fleet, 5))  # the freed GPUs take the successor
    assert again.spec.replica_id == move.successor and move.state == MoveState.DONE


def test_a_failing_successor_fails_the_move_and_the_old_one_serves_on() -> None:
    rec = make(small(1))
    fleet = nodes("gpu-01", "gpu-02")
    [first] = bring_up(rec, nodes("gpu-01"))
    old = first.spec.replica_id
    move = rec.request_move(old, 1, reason="r", avoid=["gpu-01"])
    assert isinstance(move, Move)
    [succ] = starts(rec.reconcile(fleet, 2))
    status(rec, succ, "failed", reason="bad flag", tail=["error: unrecognized arguments: --bogus"])
    rec.reconcile(fleet, 3)
    assert move.state == MoveState.FAILED and "bad flag" in move.note and move.tail
    assert serving(rec) == {old} and rec.replicas[old].state == ReplicaState.READY
    # The failed successor is stopped and forgotten, not retried, and the count stays one.
    assert succ.spec.replica_id not in rec.replicas
    assert starts(rec.reconcile(fleet, 60)) == [] and set(rec.replicas) == {old}
    assert [n for n in rec.drain_notes() if n.detail]  # the engine's last lines go to the event log
