"""The drain's decisions over a real reconciler (drain.Drainer) with a fake clock: one replica
moved at a time, across models too; no room fails without --force and retires with it; a
restarted server (a new Drainer over the same marks file) resumes the drain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmgw.catalog.schema import Model, Profile
from llmgw.server.drain import Drainer, MarkStore
from llmgw.server.reconcile import NodeInfo, Reconciler
from llmgw.server.states import MoveState
from llmgw.wire import messages as m
from tests.unit.test_moves import ready
from tests.unit.test_reconcile import bring_up, make, nodes, starts, stops


class Registry:
    def __init__(self, *ids: str) -> None:
        self.ids = set(ids)

    def get(self, node_id: str) -> Any:
        return object() if node_id in self.ids else None


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def with_marks(fleet: list[NodeInfo], drainer: Drainer) -> list[NodeInfo]:
    return [NodeInfo(node_id=n.node_id, state=n.state, gpus=n.gpus, features=n.features, endpoint_host=n.endpoint_host,
                     cordoned=n.node_id in drainer.cordoned()) for n in fleet]


def run(rec: Reconciler, drainer: Drainer, fleet: list[NodeInfo], clock: Clock) -> list:
    """A pass as the controller runs it: reconcile, the gateway syncs, the drainer looks; engines
    asked to stop or drain exit, and new ones become ready."""
    clock.t += 1
    actions = rec.reconcile(with_marks(fleet, drainer), clock.t)
    rec.rotation_synced()
    drainer.after_pass()
    ready(rec, starts(actions))
    for stop in stops(actions):
        rec.on_shard_status(stop.node, m.ShardStatus(shard_id=stop.shard_id, replica_id="", state="stopped"), clock.t)
    return actions


def models() -> list[Model]:
    return [Model(name=n, replicas=1, profiles=[Profile(name="p", engine="sim", gpus=1)]) for n in ("a", "b")]


def test_a_drain_moves_one_replica_at_a_time_and_ends_with_the_node_empty(tmp_path: Path) -> None:
    rec = make(models())
    clock = Clock()
    bring_up(rec, nodes("gpu-01"))
    drainer = Drainer(MarkStore(tmp_path), rec, Registry("gpu-01", "gpu-02"), now=clock, wake=lambda: None)
    view = drainer.drain("gpu-01", "alice", force=False)
    assert not isinstance(view, str) and view.in_progress and not view.done
    fleet = nodes("gpu-01", "gpu-02")
    in_flight = []
    for _ in range(30):
        run(rec, drainer, fleet, clock)
        in_flight.append(sum(1 for mv in rec.moves.values() if mv.state not in (MoveState.DONE, MoveState.FAILED)))
        view = drainer.view("gpu-01")
        assert view is not None
        if view.done:
            break
    assert view.done and not view.failed and max(in_flight) == 1  # one at a time, across models too
    assert {s.node for r in rec.replicas.values() for s in r.shards} == {"gpu-02"}
    run(rec, drainer, fleet, clock)  # the pass after the last engine's exit ends its move
    assert [i.move for i in (drainer.view("gpu-01") or view).items] == ["done", "done"]


def test_no_room_fails_without_force_and_retires_with_it_and_a_restart_resumes(tmp_path: Path) -> None:
    rec = make(models())
    clock = Clock()
    bring_up(rec, nodes("gpu-01"))
    registry = Registry("gpu-01")
    drainer = Drainer(MarkStore(tmp_path), rec, registry, now=clock, wake=lambda: None)
    drainer.drain("gpu-01", "alice", force=False)
    fleet = nodes("gpu-01")
    for _ in range(6):
        run(rec, drainer, fleet, clock)
    view = drainer.view("gpu-01")
    assert view is not None and not view.done and not view.in_progress
    assert len(view.failed) == 2 and all("no room" in line for line in view.failed)
    assert len(rec.replicas) == 2 and all(r.state == "ready" for r in rec.replicas.values())  # nothing stopped
    # A restarted server: a new Drainer over the same file finds the mark and moves, once there is room.
    again = Drainer(MarkStore(tmp_path), rec, registry, now=clock, wake=lambda: None)
    assert again.mark_of("gpu-01") == "draining"
    fleet = nodes("gpu-01", "gpu-02")
    for _ in range(30):
        run(rec, again, fleet, clock)
        if (v := again.view("gpu-01")) is not None and v.done:
            break
    assert {s.node for r in rec.replicas.values() for s in r.shards} == {"gpu-02"}
    moved = [i for i in again.view("gpu-01").items if i.successor and i.move == "done"]
    assert moved and all(i.note == f"{i.replica} retired; {i.successor} serves instead" for i in moved), moved
    # --force with nowhere to go: retired, and named as down.
    rec2 = make(models()[:1])
    bring_up(rec2, nodes("gpu-01"))
    forced = Drainer(MarkStore(tmp_path / "b"), rec2, registry, now=clock, wake=lambda: None)
    forced.drain("gpu-01", "bob", force=True)
    for _ in range(6):
        run(rec2, forced, nodes("gpu-01"), clock)
    view = forced.view("gpu-01")
    assert view is not None and view.done and len(view.down) == 1, view
    # Its note says what is true: the successor waits for room, it does not serve (issue 46, item 6).
    [item] = [i for i in view.items if i.successor]
    assert rec2.replicas[item.successor].state == "pending"
    assert item.note == f"{item.replica} retired; {item.successor} is pending and serves once ready", item.note
