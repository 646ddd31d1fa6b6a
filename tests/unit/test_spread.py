"""The spread decision (placement/spread.py, issue 18) on a fake clock: time is a number passed in."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from llmgw.fabric.analysis import analyse
from llmgw.fabric.ibnetdiscover import parse_topology
from llmgw.fabric.locality import places
from llmgw.placement.spread import (
    DEFAULT_COOLDOWN,
    SpreadModel,
    SpreadNode,
    SpreadReplica,
    crowded,
    decide,
    domain_of,
)
from llmgw.server.reconcile import Reconciler, Settings
from llmgw.server.states import MoveState
from llmgw.sim.fabric import FabricSpec, generate
from llmgw.wire import messages as m

MODEL = "llama-3.1-8b-instruct"
T0 = 1000.0


def model(*on: str, desired: int | None = None, ready: int | None = None, moving: bool = False,
          last: float | None = None, name: str = MODEL) -> SpreadModel:
    count = len(on) if ready is None else ready
    replicas = tuple(SpreadReplica(id=f"{name}-{i}", nodes=(node,), ready=i < count) for i, node in enumerate(on))
    return SpreadModel(name=name, desired=len(on) if desired is None else desired, replicas=replicas, moving=moving,
                       last_move_at=last)


def nodes(*ids: str, cordoned: tuple[str, ...] = (), down: tuple[str, ...] = (),
          leaves: dict[str, tuple[str, ...]] | None = None) -> list[SpreadNode]:
    return [SpreadNode(node_id=n, ready=n not in down, cordoned=n in cordoned, leaves=(leaves or {}).get(n, ()))
            for n in ids]


def everywhere(ns: list[SpreadNode], *models: str) -> dict[str, list[str]]:
    return {m: [n.node_id for n in ns] for m in models or (MODEL,)}


def test_a_late_node_triggers_one_move_with_a_reason_a_person_reads() -> None:
    fleet = nodes("gpu-01")
    m = model("gpu-01", "gpu-01")
    assert decide([m], fleet, "nodes", T0, everywhere(fleet)) == []  # nowhere else to go
    fleet = nodes("gpu-01", "gpu-02")  # gpu-02 registers late
    assert crowded([m], fleet, "nodes", T0) == [MODEL]
    [move] = decide([m], fleet, "nodes", T0, everywhere(fleet))
    assert move.reason == f"spread: 2 of 2 replicas of {MODEL} on gpu-01; gpu-02 can take one"
    assert (move.model, move.node, move.avoid, move.to) == (MODEL, "gpu-01", ("gpu-01",), ("gpu-02",))
    assert move.replica in {r.id for r in m.replicas}
    # While that move is unfinished, no second one for the model; once spread, none at all.
    assert decide([model("gpu-01", "gpu-01", moving=True)], fleet, "nodes", T0 + 1, everywhere(fleet)) == []
    assert decide([model("gpu-01", "gpu-02", last=T0)], fleet, "nodes", T0 + 10 * DEFAULT_COOLDOWN,
                  everywhere(fleet)) == []


def test_one_move_per_model_per_decision_even_with_many_crowded() -> None:
    fleet = nodes("gpu-01", "gpu-02", "gpu-03", "gpu-04")
    moves = decide([model("gpu-01", "gpu-01", "gpu-01", "gpu-01"), model("gpu-02", "gpu-02", name="other")], fleet,
                   "nodes", T0,
                   everywhere(fleet, MODEL, "other"))
    assert sorted(mv.model for mv in moves) == [MODEL, "other"]
    mine = next(mv for mv in moves if mv.model == MODEL)
    assert mine.reason.startswith(f"spread: 4 of 4 replicas of {MODEL} on gpu-01;")
    assert mine.to == ("gpu-02", "gpu-03", "gpu-04") and mine.avoid == ("gpu-01",)


def test_cooldown_is_respected_on_the_fake_clock() -> None:
    fleet = nodes("gpu-01", "gpu-02")
    for cooldown in (DEFAULT_COOLDOWN, 2.0):
        just_moved = model("gpu-01", "gpu-01", last=T0)
        assert decide([just_moved], fleet, "nodes", T0 + cooldown - 0.001, everywhere(fleet), cooldown) == []
        assert crowded([just_moved], fleet, "nodes", T0 + cooldown - 0.001, cooldown) == []
        assert len(decide([just_moved], fleet, "nodes", T0 + cooldown, everywhere(fleet), cooldown)) == 1
    assert DEFAULT_COOLDOWN == 300.0  # the 5 minutes


def test_no_move_while_the_model_is_below_its_desired_ready_count() -> None:
    fleet = nodes("gpu-01", "gpu-02")
    assert decide([model("gpu-01", "gpu-01", ready=1)], fleet, "nodes", T0, everywhere(fleet)) == []
    assert decide([model("gpu-01", "gpu-01", desired=3)], fleet, "nodes", T0, everywhere(fleet)) == []
    assert crowded([model("gpu-01", "gpu-01", ready=1)], fleet, "nodes", T0) == []
    assert len(decide([model("gpu-01", "gpu-01", desired=2)], fleet, "nodes", T0, everywhere(fleet))) == 1


def test_cordoned_unready_and_full_nodes_are_not_targets() -> None:
    m = model("gpu-01", "gpu-01")
    cordoned = nodes("gpu-01", "gpu-02", cordoned=("gpu-02",))
    assert decide([m], cordoned, "nodes", T0, everywhere(cordoned)) == []
    down = nodes("gpu-01", "gpu-02", down=("gpu-02",))
    assert decide([m], down, "nodes", T0, everywhere(down)) == []
    fleet = nodes("gpu-01", "gpu-02")
    assert decide([m], fleet, "nodes", T0, {MODEL: ["gpu-01"]}) == []  # gpu-02 has no room for it
    assert decide([m], fleet, "nodes", T0, {}) == []
    three = nodes("gpu-01", "gpu-02", "gpu-03", cordoned=("gpu-02",))
    [move] = decide([m], three, "nodes", T0, everywhere(three))
    assert move.to == ("gpu-03",)


def test_no_ping_pong_when_the_spread_is_as_even_as_it_gets() -> None:
    fleet = nodes("gpu-01", "gpu-02")
    assert decide([model("gpu-01", "gpu-01", "gpu-02")], fleet, "nodes", T0, everywhere(fleet)) == []
    fleet3 = nodes("gpu-01", "gpu-02", "gpu-03")
    [move] = decide([model("gpu-01", "gpu-01", "gpu-01", "gpu-02")], fleet3, "nodes", T0, everywhere(fleet3))
    assert move.to == ("gpu-03", "gpu-02") and move.avoid == ("gpu-01",)  # the empty node first; 2 + 2 beats 3 + 1 too


def test_off_moves_nothing() -> None:
    fleet = nodes("gpu-01", "gpu-02")
    assert decide([model("gpu-01", "gpu-01")], fleet, "off", T0, everywhere(fleet)) == []
    assert crowded([model("gpu-01", "gpu-01")], fleet, "off", T0) == []


def test_leaves_are_honoured_when_fabric_data_exists() -> None:
    same_leaf = {"gpu-01": ("leaf-a",), "gpu-02": ("leaf-a",), "gpu-03": ("leaf-b",)}
    fleet = nodes("gpu-01", "gpu-02", "gpu-03", leaves=same_leaf)
    m = model("gpu-01", "gpu-02")
    assert decide([m], fleet, "nodes", T0, everywhere(fleet)) == []  # different nodes: enough for `nodes`
    [move] = decide([m], fleet, "leaves", T0, everywhere(fleet))
    assert move.reason == f"spread: 2 of 2 replicas of {MODEL} on leaf leaf-a; gpu-03 can take one"
    assert move.to == ("gpu-03",) and move.avoid == ("gpu-01", "gpu-02")
    # Without fabric data a node is its own domain: `leaves` acts as `nodes`.
    bare = nodes("gpu-01", "gpu-02", "gpu-03")
    assert decide([m], bare, "leaves", T0, everywhere(bare)) == []
    assert domain_of(bare[0], "gpu-01", "leaves") == "gpu-01"


def test_leaves_from_a_generated_fabric_map_through_locality() -> None:
    """Two groups of two nodes, one rail: node-1 and node-2 share one leaf, node-3 and node-4
    another; the leaves come from the fabric map the way the server reads them (fabric/locality.py)."""
    spec = FabricSpec(nodes=["node-1", "node-2", "node-3", "node-4"], rails=1, group_size=2, spines=1)
    by_node = places("ib0", analyse(parse_topology(generate(spec).ibnetdiscover)))
    leaves = {node: tuple(sorted({p.leaf_name for p in devices.values()})) for node, devices in by_node.items()}
    assert set(leaves) == {"node-1", "node-2", "node-3", "node-4"}
    assert leaves["node-1"] == leaves["node-2"] != leaves["node-3"] == leaves["node-4"]
    fleet = [SpreadNode(node_id=n, ready=True, leaves=v) for n, v in sorted(leaves.items())]
    [move] = decide([model("node-1", "node-2")], fleet, "leaves", T0, everywhere(fleet))
    assert move.to == ("node-3", "node-4") and move.avoid == ("node-1", "node-2")
    assert move.reason.startswith(f"spread: 2 of 2 replicas of {MODEL} on leaf {leaves['node-1'][0]};")


NODE_IDS = [f"n{i}" for i in range(5)]


@given(st.lists(st.lists(st.sampled_from(NODE_IDS), min_size=0, max_size=6), max_size=4),
       st.sets(st.sampled_from(NODE_IDS)), st.sets(st.sampled_from(NODE_IDS)),
       st.sampled_from(["nodes", "leaves", "off"]),
       st.dictionaries(st.sampled_from(NODE_IDS), st.sampled_from([("a",), ("b",), ("a", "b")])))
def test_any_picture_gives_at_most_one_improving_move_per_model(placements: list[list[str]], cordoned: set[str],
                                                                down: set[str],
                                                                mode: str, leaves: dict[str, tuple[str, ...]]) -> None:
    fleet = [SpreadNode(node_id=n, ready=n not in down, cordoned=n in cordoned, leaves=leaves.get(n, ()))
             for n in NODE_IDS]
    models = [model(*on, name=f"m{i}") for i, on in enumerate(placements)]
    moves = decide(models, fleet, mode, T0, {m.name: NODE_IDS for m in models})  # type: ignore[arg-type]
    assert len({mv.model for mv in moves}) == len(moves)
    by_id = {n.node_id: n for n in fleet}
    for mv in moves:
        m = next(x for x in models if x.name == mv.model)
        counts: dict[str, int] = {}
        for r in m.replicas:
            d = domain_of(by_id[r.nodes[0]], r.nodes[0], mode)  # type: ignore[arg-type]
            counts[d] = counts.get(d, 0) + 1
        source = domain_of(by_id[mv.node], mv.node, mode)  # type: ignore[arg-type]
        assert counts[source] >= 2
        for target in mv.to:
            node = by_id[target]
            assert node.ready and not node.cordoned and target not in mv.avoid
            assert counts.get(domain_of(node, target, mode), 0) + 2 <= counts[source]  # type: ignore[arg-type]


# ---- through the reconciler: the decision drives the move primitive (server/moves.py) ----------


def spread_reconciler(replicas: int = 2, mode: str = "nodes", cooldown: float = 300.0) -> Reconciler:
    from tests.unit.test_moves import small

    settings = Settings(backoff_initial=2, backoff_max=60, port_range=(20000, 20999), spread=mode,  # type: ignore[arg-type]
                        spread_cooldown=cooldown)
    return Reconciler(small(replicas), settings, random.Random(7))


def test_the_reconciler_moves_one_replica_to_a_late_node_successor_first() -> None:
    from tests.unit.test_moves import ready, serving
    from tests.unit.test_reconcile import bring_up, starts, stops
    from tests.unit.test_reconcile import nodes as infos

    rec = spread_reconciler()
    placed = bring_up(rec, infos("gpu-01"))
    assert {s.node for s in placed} == {"gpu-01"} and len(placed) == 2
    assert rec.reconcile(infos("gpu-01"), 1) == []  # one node: nothing to move
    fleet = infos("gpu-01", "gpu-02")
    [successor] = starts(rec.reconcile(fleet, 2))  # gpu-02 joined: the successor is placed there at once
    assert successor.node == "gpu-02"
    [move] = [mv for mv in rec.moves.values()]
    assert move.kind == "spread" and move.reason == "spread: 2 of 2 replicas of small on gpu-01; gpu-02 can take one"
    assert move.avoid == ["gpu-01"] and move.state == MoveState.SURGING
    # No second move of the model while this one runs, and the old one serves until the successor is ready.
    assert rec.reconcile(fleet, 3) == [] and len(rec.moves) == 1 and len(serving(rec)) == 2
    ready(rec, [successor])
    assert stops(rec.reconcile(fleet, 4)) == []  # out of rotation first
    assert rec.rotation_synced()
    [drain] = stops(rec.reconcile(fleet, 5))
    assert drain.drain and drain.node == "gpu-01"
    rec.on_shard_status("gpu-01", m.ShardStatus(shard_id=drain.shard_id, replica_id=move.replica, state="stopped"), 6)
    rec.reconcile(fleet, 7)
    assert move.state == MoveState.DONE
    assert sorted(s.node for r in rec.replicas.values() for s in r.shards) == ["gpu-01", "gpu-02"]
    notes = [n for n in rec.drain_notes() if n.kind == "spread"]
    assert notes and notes[0].message.endswith("asked: spread: 2 of 2 replicas of small on gpu-01; gpu-02 can take one")
    # Spread now: nothing more to do, however long we wait.
    assert rec.reconcile(fleet, 10_000) == [] and len(rec.moves) == 1


def test_the_reconciler_waits_out_the_cooldown_after_a_failed_move() -> None:
    from tests.unit.test_reconcile import bring_up, starts, status
    from tests.unit.test_reconcile import nodes as infos

    rec = spread_reconciler(cooldown=60)
    bring_up(rec, infos("gpu-01"))
    fleet = infos("gpu-01", "gpu-02")
    [successor] = starts(rec.reconcile(fleet, 10))
    status(rec, successor, "failed", reason="boom")
    rec.reconcile(fleet, 11)
    [move] = rec.moves.values()
    assert move.state == MoveState.FAILED
    for now in (12, 40, 69.9):
        assert starts(rec.reconcile(fleet, now)) == [], now  # the cooldown (60 s from the ask at 10)
    [again] = starts(rec.reconcile(fleet, 70))
    assert again.node == "gpu-02" and len(rec.moves) == 2


def test_the_reconciler_moves_nothing_with_spread_off_or_a_cordoned_node() -> None:
    from tests.unit.test_reconcile import bring_up
    from tests.unit.test_reconcile import nodes as infos

    off = spread_reconciler(mode="off")
    bring_up(off, infos("gpu-01"))
    assert off.reconcile(infos("gpu-01", "gpu-02"), 1) == [] and not off.moves
    rec = spread_reconciler()
    bring_up(rec, infos("gpu-01"))
    cordoned = infos("gpu-01", "gpu-02")
    cordoned[1].cordoned = True
    assert rec.reconcile(cordoned, 1) == [] and not rec.moves


def test_the_reconciler_spreads_over_leaves_it_is_told_of() -> None:
    from tests.unit.test_reconcile import bring_up, starts
    from tests.unit.test_reconcile import nodes as infos

    rec = spread_reconciler(mode="leaves")
    two = infos("gpu-01", "gpu-02")
    for n in two:
        n.leaves = ["leaf-a"]
    placed = bring_up(rec, two)
    assert sorted(s.node for s in placed) == ["gpu-01", "gpu-02"]  # different nodes, one leaf
    three = [*two, *infos("gpu-03")]
    three[2].leaves = ["leaf-b"]
    [successor] = starts(rec.reconcile(three, 1))
    assert successor.node == "gpu-03"
    [move] = rec.moves.values()
    assert move.reason == "spread: 2 of 2 replicas of small on leaf leaf-a; gpu-03 can take one"


def test_the_controller_hands_the_reconciler_each_nodes_leaves_from_the_fabric_map() -> None:
    """The server's path: Controller.nodes() reads fabric/locality's Places (what fabric_service
    keeps) into NodeInfo.leaves, only when `placement.spread: leaves` needs them."""
    from llmgw.catalog.schema import PlacementSettings, ReconcileSettings
    from llmgw.fabric.locality import Place, Places
    from llmgw.server.control import Controller, Settle, make_reconciler
    from llmgw.server.links import FleetLinks
    from llmgw.server.registry import NodeRegistry

    fabric = places("ib0", analyse(parse_topology(generate(
        FabricSpec(nodes=["node-1", "node-2", "node-3"], rails=1, group_size=2, spines=1)).ibnetdiscover)))
    view = Places(by_node={n: dict(devices) for n, devices in fabric.items()})
    assert all(isinstance(p, Place) for devices in view.by_node.values() for p in devices.values())
    for mode, want in (("leaves", True), ("nodes", False)):
        registry = NodeRegistry(1.0)
        for i, node in enumerate(("node-1", "node-2", "node-3")):
            registry.register(m.Register(node_id=node, version="0.1.0"), 0.0, session=i + 1)
        reconciler = make_reconciler([], ReconcileSettings(), placement=PlacementSettings(spread=mode))  # type: ignore[arg-type]
        controller = Controller(reconciler, registry, settle=Settle(ReconcileSettings(), registry), links=FleetLinks(),
                                places=lambda: view)
        leaves = {n.node_id: n.leaves for n in controller.nodes()}
        if want:
            assert leaves["node-1"] == leaves["node-2"] != leaves["node-3"] and len(leaves["node-1"]) == 1, leaves
        else:
            assert all(v == [] for v in leaves.values()), leaves


def test_a_node_the_fabric_map_moves_to_another_leaf_is_a_target_at_the_next_pass() -> None:
    """A pass that found no room remembers the picture, and looks again only once it changes: a
    node's leaves are part of it. gpu-03 first under the crowded leaf (no better), then the map
    (a cable moved, a corrected node description) puts it under another: the replica moves."""
    from tests.unit.test_reconcile import bring_up, starts
    from tests.unit.test_reconcile import nodes as infos

    rec = spread_reconciler(mode="leaves")
    two = infos("gpu-01", "gpu-02")
    for n in two:
        n.leaves = ["leaf-a"]
    bring_up(rec, two)
    three = [*two, *infos("gpu-03")]
    three[2].leaves = ["leaf-a"]
    assert rec.reconcile(three, 1) == [] and not rec.moves  # gpu-03 shares their leaf: no move improves it
    three[2].leaves = ["leaf-b"]
    [successor] = starts(rec.reconcile(three, 2))
    assert successor.node == "gpu-03"
    [move] = rec.moves.values()
    assert move.reason == "spread: 2 of 2 replicas of small on leaf leaf-a; gpu-03 can take one"
