"""A lost node's replicas (lost.py), decided with no I/O and time passed in: kept while they serve,
replaced only where there is room, whole again when the node returns, and never an illegal
transition on the way (issue 41, finding 2: rank 1's agent lost took two 2-node replicas down
though their rank 0s served and nothing else could fit, with "not a legal transition" in the log)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.catalog.schema import Model, Profile
from llmgw.server.reconcile import NodeInfo, Reconciler, Settings, StartShard, StopShard
from llmgw.wire import messages as m

F = [m.FEATURE_START, m.FEATURE_STOP, m.FEATURE_DRAIN]


def gpus(n: int) -> list[m.Gpu]:
    return [m.Gpu(index=i, name="H100", memory_mib=81559) for i in range(n)]


def fleet(*ids: str, lost: tuple[str, ...] = (), per_node: int = 2) -> list[NodeInfo]:
    return [NodeInfo(node_id=i, state="lost" if i in lost else "ready", connected=i not in lost, gpus=gpus(per_node),
                     features=F, endpoint_host=i, fabrics=["ib"], address=i) for i in ids]


def make(replicas: int = 2, nodes: int = 2) -> Reconciler:
    model = Model(name="chat", replicas=replicas, profiles=[Profile(name="p", engine="sim", nodes=nodes, gpus=1)])
    return Reconciler([model], Settings(backoff_initial=1, backoff_max=8, port_range=(20000, 20999)), random.Random(7))


def up(rec: Reconciler, nodes: list[NodeInfo], now: float = 0) -> list[StartShard]:
    placed = [a for a in rec.reconcile(nodes, now) if isinstance(a, StartShard)]
    for s in placed:
        say(rec, s, "ready", now)
    return placed


def say(rec: Reconciler, start: StartShard, state: str, now: float, **kw: object) -> None:
    endpoint = f"http://{start.node}:{start.spec.port}" if state == "ready" else ""
    rec.on_shard_status(start.node, m.ShardStatus(shard_id=start.spec.shard_id, replica_id=start.spec.replica_id,
                                                  state=state, endpoint=endpoint, **kw), now)  # type: ignore[arg-type]


def back(rec: Reconciler, node: str, shards: list[StartShard], now: float, state: str = "ready") -> None:
    """The node registers again, reporting these shards."""
    rec.on_register(node, [m.ShardReport(spec=s.spec, state=state, pid=7, endpoint=f"http://{node}:{s.spec.port}")
                           for s in shards if s.node == node], now)


def in_rotation(rec: Reconciler) -> set[str]:
    """What the gateway is handed (GatewayFeed._ready): rank 0 of every ready replica."""
    return {s.endpoint for r in rec.replicas.values() if r.state == "ready" for s in r.shards
            if s.rank == 0 and s.endpoint}


def olds(rec: Reconciler) -> dict[str, str]:
    return {r.id: str(r.state) for r in rec.replicas.values() if not r.replaces}


def test_rank1_lost_with_no_room_keeps_both_replicas_serving_and_adopts_them_back() -> None:
    rec = make()
    nodes = fleet("gpu-1", "gpu-2")
    placed = up(rec, nodes)
    assert {s.node for s in placed if s.spec.rank == 0} == {"gpu-1"}  # rank 1s on gpu-2
    serving = in_rotation(rec)
    assert len(serving) == 2
    rec.on_node_state("gpu-2", "lost", 10)
    actions = rec.reconcile(fleet("gpu-1", "gpu-2", lost=("gpu-2",)), 10)
    assert actions == []  # nothing stopped, nothing started: there is no room
    assert olds(rec) == dict.fromkeys(olds(rec), "ready") and in_rotation(rec) == serving
    moves = [mv for mv in rec.moves.values() if mv.kind == "lost"]
    assert len(moves) == 2 and {mv.state for mv in moves} == {"surging"}  # together, not one after the other
    assert all(mv.note.startswith("no room for a successor") and "gpu-2: lost" in mv.note for mv in moves)
    for replica in rec.replicas.values():
        if not replica.replaces:
            assert replica.reason.startswith("gpu-2 lost: serving on")
    # Rank 0's agent says something meanwhile: the replica is still ready (lost is not a shard that ended).
    say(rec, placed[0], "ready", 11)
    assert in_rotation(rec) == serving
    assert rec.reconcile(fleet("gpu-1", "gpu-2", lost=("gpu-2",)), 12) == []
    # The node returns with its engines: the same replicas, whole; the waiting successors go.
    back(rec, "gpu-2", placed, 20)
    assert rec.reconcile(nodes, 20) == []
    assert sorted(rec.replicas) == sorted({s.spec.replica_id for s in placed})
    assert all(s.state == "ready" for r in rec.replicas.values() for s in r.shards) and in_rotation(rec) == serving
    assert {mv.state for mv in moves} == {"done"} and rec.kept == {}
    assert rec.drain_illegal() == []


def test_forgetting_the_lost_node_ends_the_wait_and_its_replicas_are_placed_again() -> None:
    rec = make(replicas=1)
    placed = up(rec, fleet("gpu-1", "gpu-2"))
    rec.on_node_state("gpu-2", "lost", 10)
    assert rec.reconcile(fleet("gpu-1", "gpu-2", lost=("gpu-2",)), 10) == []
    [move] = rec.moves.values()
    assert move.state == "surging" and move.note.startswith("no room")
    rec.on_node_gone("gpu-2", 20)  # `ctl forget gpu-2`
    replica = rec.replicas[placed[0].spec.replica_id]
    assert replica.state == "failed" and "forgotten" in replica.reason
    [stop] = [a for a in rec.reconcile(fleet("gpu-1"), 20) if isinstance(a, StopShard)]
    assert stop.shard_id == placed[0].spec.shard_id and move.state == "done"
    say(rec, placed[0], "stopped", 21)
    rec.reconcile(fleet("gpu-1"), 21)
    assert [r.state for r in rec.replicas.values()] == ["pending"]  # one replica, waiting for a second node
    assert rec.drain_illegal() == []


def test_the_gateway_feed_keeps_a_lost_replicas_endpoint_until_its_successor_is_ready() -> None:
    """The production path from the book to the gateway (views.GatewayFeed), not the test's own
    reading of it: the endpoint on the lost node is handed to the gateway until the swap."""
    from llmgw.catalog.schema import ReconcileSettings
    from llmgw.server.control import Settle
    from llmgw.server.registry import NodeRegistry
    from llmgw.server.views import GatewayFeed

    rec = make(replicas=1, nodes=1)
    feed = GatewayFeed(rec, Settle(ReconcileSettings(), NodeRegistry(1.0)), lambda: 0.0)
    [s] = up(rec, fleet("gpu-1", "gpu-2", per_node=1))
    old = f"http://{s.node}:{s.spec.port}"
    assert feed.endpoint_set()[0] == {"chat": {old}}
    rec.on_node_state(s.node, "lost", 10)
    lost = fleet("gpu-1", "gpu-2", lost=(s.node,), per_node=1)
    [successor] = [a for a in rec.reconcile(lost, 10) if isinstance(a, StartShard)]
    assert feed.endpoint_set()[0] == {"chat": {old}}
    say(rec, successor, "ready", 11)
    new = f"http://{successor.node}:{successor.spec.port}"
    assert feed.endpoint_set()[0] == {"chat": {old, new}}  # both, until the pass retires the old one
    rec.reconcile(lost, 11)
    assert feed.endpoint_set()[0] == {"chat": {new}}


def test_a_lost_single_node_replica_serves_until_its_successor_is_ready() -> None:
    rec = make(replicas=1, nodes=1)
    [s] = up(rec, fleet("gpu-1", "gpu-2", per_node=1))
    rec.on_node_state(s.node, "lost", 10)
    other = "gpu-2" if s.node == "gpu-1" else "gpu-1"
    lost = fleet("gpu-1", "gpu-2", lost=(s.node,), per_node=1)
    [successor] = [a for a in rec.reconcile(lost, 10) if isinstance(a, StartShard)]
    assert successor.node == other
    assert in_rotation(rec) == {f"http://{s.node}:{s.spec.port}"}  # still the old one, while the successor starts
    say(rec, successor, "starting", 11)
    assert rec.reconcile(lost, 11) == [] and in_rotation(rec) == {f"http://{s.node}:{s.spec.port}"}
    say(rec, successor, "ready", 12)
    assert rec.reconcile(lost, 12) == []
    # one pass: the one swapped for the other
    assert in_rotation(rec) == {f"http://{successor.node}:{successor.spec.port}"}
    assert rec.replicas[s.spec.replica_id].state == "draining"
    rec.rotation_synced()
    assert rec.reconcile(lost, 13) == []  # nothing to drain on a lost node: the old replica is let go
    assert list(rec.replicas) == [successor.spec.replica_id]
    # Its node comes back with the old engine: adopted, then stopped as the surplus (seen last).
    back(rec, s.node, [s], 20)
    [stop] = [a for a in rec.reconcile(fleet("gpu-1", "gpu-2", per_node=1), 20) if isinstance(a, StopShard)]
    assert stop.shard_id == s.spec.shard_id
    assert rec.drain_illegal() == []


def test_a_kept_replica_whose_successor_is_ready_drains_only_its_reachable_ranks() -> None:
    rec = make(replicas=1)
    nodes = fleet("gpu-1", "gpu-2", "gpu-3")
    placed = up(rec, nodes)
    [rank1] = [s for s in placed if s.spec.rank == 1]
    rec.on_node_state(rank1.node, "lost", 10)
    lost = fleet("gpu-1", "gpu-2", "gpu-3", lost=(rank1.node,))
    successor = [a for a in rec.reconcile(lost, 10) if isinstance(a, StartShard)]
    assert len(successor) == 2 and rank1.node not in {a.node for a in successor}
    for a in successor:
        say(rec, a, "ready", 11)
    rec.reconcile(lost, 11)
    rec.rotation_synced()
    drains = [a for a in rec.reconcile(lost, 12) if isinstance(a, StopShard)]
    assert [(d.shard_id, d.drain) for d in drains] == [(placed[0].spec.shard_id, True)]  # rank 0; rank 1 is unknown
    say(rec, placed[0], "stopped", 13)
    assert placed[0].spec.replica_id not in rec.replicas
    assert rec.drain_illegal() == []


def test_a_node_back_without_the_lost_shard_fails_its_replica_and_it_is_placed_again() -> None:
    rec = make(replicas=1)
    nodes = fleet("gpu-1", "gpu-2")
    placed = up(rec, nodes)
    rec.on_node_state("gpu-2", "lost", 10)
    rec.reconcile(fleet("gpu-1", "gpu-2", lost=("gpu-2",)), 10)
    rec.on_register("gpu-2", [], 20)  # the engine went away while the node was lost
    replica = rec.replicas[placed[0].spec.replica_id]
    assert replica.state == "failed" and "back without" in replica.reason
    assert [s.state for s in replica.shards] == ["stopping", "exited"]
    actions = rec.reconcile(nodes, 20)
    assert [a.shard_id for a in actions if isinstance(a, StopShard)] == [placed[0].spec.shard_id]
    assert not any(mv.kind == "lost" and mv.state not in ("done", "failed") for mv in rec.moves.values())
    assert rec.drain_illegal() == []


def test_a_rank_back_into_a_replica_given_up_is_stopped_not_wedged_and_nothing_is_illegal() -> None:
    """The finding's log: a replica failed at `lost` waited pending; its rank 1 came back ready (it
    stayed starting with a stopped rank 0, for good) or exited (pending → failed, refused)."""
    for returning in ("ready", "exited"):
        rec = make(replicas=1)
        nodes = fleet("gpu-1", "gpu-2")
        placed = [a for a in rec.reconcile(nodes, 0) if isinstance(a, StartShard)]
        say(rec, placed[0], "ready", 1)  # rank 0 up, rank 1 still starting: never served
        rec.on_node_state("gpu-2", "lost", 10)
        replica = rec.replicas[placed[0].spec.replica_id]
        assert replica.state == "failed"
        lost = fleet("gpu-1", "gpu-2", lost=("gpu-2",))
        [stop] = [a for a in rec.reconcile(lost, 10) if isinstance(a, StopShard)]
        assert stop.shard_id == placed[0].spec.shard_id  # rank 0, though it served
        say(rec, placed[0], "stopped", 11)
        rec.reconcile(lost, 11)
        assert replica.state == "pending" and "no placement" in replica.reason
        back(rec, "gpu-2", placed, 20, state=returning)
        actions = rec.reconcile(nodes, 20)
        stops = [a.shard_id for a in actions if isinstance(a, StopShard)]
        if returning == "ready":
            assert stops == [placed[1].spec.shard_id] and replica.state == "pending"  # it serves nobody: stopped
            assert not [a for a in actions if isinstance(a, StartShard)]  # and its GPU is not free until it has
            rec.on_shard_status("gpu-2", m.ShardStatus(shard_id=placed[1].spec.shard_id, replica_id=replica.id,
                                                       state="stopped"), 21)
        else:
            assert stops == [] and replica.failures == 0  # an end already given up on is no new failure
        started = [a for a in [*actions, *rec.reconcile(nodes, 22)] if isinstance(a, StartShard)]
        assert len(started) == 2 and all(a.spec.replica_id == replica.id for a in started)
        assert rec.drain_illegal() == [], returning


def test_a_failed_successor_backs_off_before_the_next_and_the_old_one_serves_on() -> None:
    rec = make(replicas=1, nodes=1)
    [s] = up(rec, fleet("gpu-1", "gpu-2", per_node=1))
    rec.on_node_state(s.node, "lost", 10)
    lost = fleet("gpu-1", "gpu-2", lost=(s.node,), per_node=1)
    [first] = [a for a in rec.reconcile(lost, 10) if isinstance(a, StartShard)]
    say(rec, first, "failed", 11, reason="CUDA out of memory")
    rec.reconcile(lost, 11)  # the move fails, the successor is stopped
    rec.on_shard_status(first.node, m.ShardStatus(shard_id=first.spec.shard_id, replica_id=first.spec.replica_id,
                                                  state="stopped"), 11)
    assert [a for a in rec.reconcile(lost, 11.5) if isinstance(a, StartShard)] == []  # backoff: 1 s
    assert rec.next_deadline() == 12.5
    assert rec.replicas[s.spec.replica_id].state == "ready" and in_rotation(rec) == {f"http://{s.node}:{s.spec.port}"}
    [second] = [a for a in rec.reconcile(lost, 12.5) if isinstance(a, StartShard)]
    assert second.node == first.node and second.spec.replica_id != first.spec.replica_id
    assert rec.drain_illegal() == []


def test_starting_replicas_on_a_lost_node_are_replaced_as_before_and_forgotten_nodes_fail_at_once() -> None:
    rec = make(replicas=1, nodes=1)
    [s] = [a for a in rec.reconcile(fleet("gpu-1", "gpu-2", per_node=1), 0) if isinstance(a, StartShard)]
    rec.on_node_state(s.node, "lost", 1)
    assert rec.replicas[s.spec.replica_id].state == "failed"  # never served: nothing to keep
    rec2 = make(replicas=1, nodes=1)
    [t] = up(rec2, fleet("gpu-1", "gpu-2", per_node=1))
    rec2.on_node_state(t.node, "lost", 1)
    assert rec2.replicas[t.spec.replica_id].state == "ready"
    rec2.on_node_gone(t.node, 2)  # `ctl forget`: gone for good
    assert rec2.replicas[t.spec.replica_id].state == "failed" and rec2.kept == {}
    assert rec.drain_illegal() == [] and rec2.drain_illegal() == []


EVENTS = st.lists(st.tuples(st.sampled_from(["lost", "back", "back-empty", "resync", "ready", "exited", "stopped"]),
                            st.integers(min_value=0, max_value=7), st.booleans()), max_size=30)


@settings(max_examples=150, deadline=None)
@given(EVENTS)
def test_no_sequence_of_losses_returns_and_reports_asks_an_illegal_transition(
    events: list[tuple[str, int, bool]]
) -> None:
    """Nodes lost and back (with their engines, or without), shards reporting, passes: the
    reconciler never asks a transition the tables refuse, and a replica is never ready without
    a rank 0 endpoint to hand the gateway, or a GPU given to two engines that may both run."""
    rec = make(replicas=2)
    ids = ("gpu-1", "gpu-2", "gpu-3")
    lost: set[str] = set()
    starts: list[StartShard] = up(rec, fleet(*ids))  # from a serving fleet: two 2-node replicas
    ended: set[str] = set()  # shards that said they ended: an agent reports nothing of them again
    now = 0.0
    for kind, k, then_a_pass in events:
        now += 1
        node = ids[k % len(ids)]
        if kind == "lost" and node not in lost:
            rec.on_node_state(node, "lost", now)
            lost.add(node)
        elif kind in ("back", "back-empty") and node in lost:
            lost.discard(node)
            known = [s for s in starts if s.node == node and s.spec.shard_id not in ended] if kind == "back" else []
            back(rec, node, known, now)
            if kind == "back-empty":
                ended |= {s.spec.shard_id for s in starts if s.node == node}
        elif kind == "resync" and node not in lost:  # a heartbeat's list, as the node's agent sees it
            running = [s for s in starts if s.node == node and s.spec.shard_id not in ended]
            rec.on_resync(node, [m.ShardReport(spec=s.spec, state="ready", pid=7, endpoint=f"http://{node}:{s.spec.port}")
                                 for s in running], now)
        elif kind in ("ready", "exited", "stopped") and starts:
            start = starts[k % len(starts)]
            if start.node not in lost and start.spec.shard_id not in ended:
                say(rec, start, kind, now)
                if kind != "ready":
                    ended.add(start.spec.shard_id)
        if then_a_pass:  # as the driver runs one (a change wakes it) and the gateway then syncs
            starts += [a for a in rec.reconcile(fleet(*ids, lost=tuple(sorted(lost))), now)
                       if isinstance(a, StartShard)]
            rec.rotation_synced()
        assert rec.drain_illegal() == [], (kind, node)
        held: dict[tuple[str, int], str] = {}
        for replica in rec.replicas.values():
            if replica.state == "ready":
                assert any(s.rank == 0 and s.endpoint for s in replica.shards), replica
            for shard in replica.shards:
                if shard.state in ("starting", "ready", "unhealthy", "stopping", "lost"):
                    for gpu in shard.gpus:  # an engine that may run keeps its GPU: none is placed twice
                        assert (shard.node, gpu) not in held, (shard.shard_id, held[(shard.node, gpu)])
                        held[(shard.node, gpu)] = shard.shard_id
