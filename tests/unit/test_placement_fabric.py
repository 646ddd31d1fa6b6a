"""Multi-node placement reading the fabric map, on fabrics `llmgw sim fabric` generates: nodes under
one leaf together, then the fewest switch hops, nodes whose cable trained short last (and the notes
saying so); the map read through the node's own devices of the fabric; nodes the map lacks after
the ones it has. The node ids are interleaved across leaves, so an order by id alone fails these."""

from __future__ import annotations

from llmgw.fabric.analysis import analyse
from llmgw.fabric.ibnetdiscover import parse_topology
from llmgw.fabric.locality import Places, merge, places
from llmgw.placement import NodeCapacity, NoFit, Request
from llmgw.placement.multi import MultiPlacement, place_multi
from llmgw.sim.fabric import FabricSpec, generate
from llmgw.wire.messages import Gpu
from tests.realfixtures import REAL

PORTS = (20000, 20099)
# Leaf 1 (group 1) gets the odd nodes, leaf 2 the even ones: by id alone, gpu-1 … gpu-4 would mix them.
INTERLEAVED = ["gpu-1", "gpu-3", "gpu-5", "gpu-7", "gpu-2", "gpu-4", "gpu-6", "gpu-8"]


def fabric_places(nodes: list[str], **kw: object) -> Places:
    fabric = generate(FabricSpec(nodes=nodes, **kw))  # type: ignore[arg-type]
    return merge({"0xfab": places("0xfab", analyse(parse_topology(fabric.ibnetdiscover)))})


def capacity(node_id: str, gpus: int = 8, used: set[int] | None = None,
             devices: list[str] | None = None) -> NodeCapacity:
    return NodeCapacity(node_id=node_id, state="ready", address=f"10.0.0.{node_id.rsplit('-', 1)[1]}",
                        gpus=[Gpu(index=i, name="NVIDIA H100 80GB HBM3", memory_mib=81559) for i in range(gpus)],
                        used_gpus=used or set(), fabrics=["ib"], fabric_devices={"ib": devices} if devices else {})


def fleet(ids: list[str], **overrides: NodeCapacity) -> list[NodeCapacity]:
    return [overrides.get(i, capacity(i)) for i in sorted(ids)]


def nodes_of(got: MultiPlacement | NoFit) -> list[str]:
    assert isinstance(got, MultiPlacement), got
    return [r.node_id for r in got.ranks]


def test_without_a_map_the_order_is_the_old_one() -> None:
    got = place_multi(Request(replica_id="big-x.1", gpus=8), 4, fleet(INTERLEAVED), PORTS)
    assert nodes_of(got) == ["gpu-1", "gpu-2", "gpu-3", "gpu-4"]
    assert isinstance(got, MultiPlacement) and got.notes == ()


def test_four_nodes_land_under_one_leaf() -> None:
    fabric = fabric_places(INTERLEAVED, rails=1, group_size=4, spines=2)
    got = place_multi(Request(replica_id="big-x.1", gpus=8), 4, fleet(INTERLEAVED), PORTS, fabric)
    assert nodes_of(got) == ["gpu-1", "gpu-3", "gpu-5", "gpu-7"]
    assert isinstance(got, MultiPlacement) and got.notes == ("under one leaf: leaf-g1-r0",)


def test_a_short_cable_moves_the_placement_to_the_other_leaf_and_says_why() -> None:
    fabric = fabric_places(INTERLEAVED, rails=1, group_size=4, spines=2, speed="HDR", degraded=["gpu-3"])
    got = place_multi(Request(replica_id="big-x.1", gpus=8), 4, fleet(INTERLEAVED), PORTS, fabric)
    assert nodes_of(got) == ["gpu-2", "gpu-4", "gpu-6", "gpu-8"]
    assert isinstance(got, MultiPlacement)
    assert got.notes == ("under one leaf: leaf-g2-r0", "gpu-3: cable to leaf-g1-r0 trained 1xHDR (others 4xHDR)")


def test_a_healthy_set_across_a_spine_beats_one_leaf_with_a_short_cable() -> None:
    # Leaf 1 has four nodes, one of them slow; leaf 2 only three free: the replica crosses a spine.
    fabric = fabric_places(INTERLEAVED, rails=1, group_size=4, spines=2, degraded=["gpu-3"])
    busy = capacity("gpu-8", used=set(range(8)))
    got = place_multi(Request(replica_id="big-x.1", gpus=8), 4, fleet(INTERLEAVED, **{"gpu-8": busy}), PORTS, fabric)
    chosen = set(nodes_of(got))
    assert "gpu-3" not in chosen
    assert isinstance(got, MultiPlacement) and got.notes[0].startswith("2 switch hops apart (through a spine)")
    assert got.notes[1] == "gpu-3: cable to leaf-g1-r0 trained 1xNDR (others 4xNDR)"
    # Three under one leaf and the fourth from the other (not two and two: more pairs a leaf apart).
    odd = {"gpu-1", "gpu-5", "gpu-7"}
    assert sorted([len(chosen & odd), len(chosen - odd)]) == [1, 3]


def test_across_a_spine_the_bigger_leaf_group_goes_first_when_the_leaves_differ() -> None:
    # Issue 37: the test above gives both leaves three healthy nodes, so picking the smaller
    # group first ties and the tie-break hides it. Here leaf 2 (even ids) has three healthy
    # nodes (gpu-2's cable is short) and leaf 1 two free ones, holding the lowest ids: three
    # and one (three pairs a leaf apart), not two and two (four pairs), whatever the ids say.
    fabric = fabric_places(INTERLEAVED, rails=1, group_size=4, spines=2, degraded=["gpu-2"])
    busy = {n: capacity(n, used=set(range(8))) for n in ("gpu-5", "gpu-7")}
    got = place_multi(Request(replica_id="big-x.1", gpus=8), 4, fleet(INTERLEAVED, **busy), PORTS, fabric)
    assert set(nodes_of(got)) == {"gpu-4", "gpu-6", "gpu-8", "gpu-1"}
    assert nodes_of(got)[:3] == ["gpu-4", "gpu-6", "gpu-8"]  # the bigger group first, rank 0 in it
    assert isinstance(got, MultiPlacement) and got.notes[0].startswith("2 switch hops apart (through a spine)")


def test_a_short_cable_is_placed_last_when_no_set_without_it_fits() -> None:
    ids = ["gpu-1", "gpu-2", "gpu-3", "gpu-4"]
    fabric = fabric_places(ids, rails=1, group_size=4, spines=1, degraded=["gpu-1"])
    got = place_multi(Request(replica_id="big-x.1", gpus=8), 4, fleet(ids), PORTS, fabric)
    assert nodes_of(got) == ["gpu-2", "gpu-3", "gpu-4", "gpu-1"]  # last: never rank 0, the master
    assert isinstance(got, MultiPlacement) and got.master_addr == "10.0.0.2"
    assert "gpu-1: cable to leaf-g1-r0 trained 1xNDR (others 4xNDR); placed: no set without it fits" in got.notes


def test_fewest_switch_hops_one_pod_before_across_the_core() -> None:
    # Three tiers: pods of two leaves (groups of two nodes); pod 1 is gpu-1,3,5,7, pod 2 the even ones.
    fabric = fabric_places(INTERLEAVED, rails=1, group_size=2, spines=2, core=2, groups_per_pod=2)
    got = place_multi(Request(replica_id="big-x.1", gpus=8), 4, fleet(INTERLEAVED), PORTS, fabric)
    assert nodes_of(got) == ["gpu-1", "gpu-3", "gpu-5", "gpu-7"]
    assert isinstance(got, MultiPlacement) and got.notes[0] == (
        "2 switch hops apart (through a spine), leaves leaf-g1-r0, leaf-g2-r0")
    # Pod 1 one node short: four hops through the core, pod 2's four rather than a mix.
    busy = capacity("gpu-7", used={0})
    got = place_multi(Request(replica_id="big-x.1", gpus=8), 4, fleet(INTERLEAVED, **{"gpu-7": busy}), PORTS, fabric)
    assert nodes_of(got) == ["gpu-2", "gpu-4", "gpu-6", "gpu-8"]
    # A 6-node replica must cross the core; it takes both leaves of one pod whole.
    got = place_multi(Request(replica_id="big-x.1", gpus=8), 6, fleet(INTERLEAVED), PORTS, fabric)
    assert isinstance(got, MultiPlacement) and got.notes[0].startswith("4 switch hops apart (through the core)")
    assert {"gpu-1", "gpu-3", "gpu-5", "gpu-7"} <= set(nodes_of(got))


def test_rail_optimised_nodes_of_a_group_share_every_rails_leaf() -> None:
    fabric = fabric_places(INTERLEAVED, rails=2, group_size=4, spines=2)
    got = place_multi(Request(replica_id="big-x.1", gpus=8), 2, fleet(INTERLEAVED), PORTS, fabric)
    assert nodes_of(got) == ["gpu-1", "gpu-3"]
    assert isinstance(got, MultiPlacement) and got.notes == ("under the same leaves: leaf-g1-r0, leaf-g1-r1",)


def test_the_map_is_read_through_the_fabrics_own_devices() -> None:
    # gpu-3's mlx5_1 trained short, but its fabric uses mlx5_0 only: not a short cable for it.
    fabric = fabric_places(INTERLEAVED, rails=2, group_size=4, spines=2, degraded=["gpu-3:mlx5_1"])
    ids = fleet(INTERLEAVED, **{n: capacity(n, devices=["mlx5_0"]) for n in INTERLEAVED})
    got = place_multi(Request(replica_id="big-x.1", gpus=8), 4, ids, PORTS, fabric)
    assert nodes_of(got) == ["gpu-1", "gpu-3", "gpu-5", "gpu-7"]
    assert isinstance(got, MultiPlacement) and got.notes == ("under one leaf: leaf-g1-r0",)
    both = fleet(INTERLEAVED)  # every device: the short cable counts
    assert "gpu-3" not in nodes_of(place_multi(Request(replica_id="big-x.1", gpus=8), 4, both, PORTS, fabric))


def test_nodes_the_map_lacks_come_after_the_ones_it_has() -> None:
    fabric = fabric_places(INTERLEAVED[:6], rails=1, group_size=3, spines=2)  # gpu-6, gpu-8 not discovered yet
    got = place_multi(Request(replica_id="big-x.1", gpus=8), 7, fleet(INTERLEAVED), PORTS, fabric)
    chosen = nodes_of(got)
    assert len(chosen) == 7 and set(INTERLEAVED[:6]) <= set(chosen)
    assert isinstance(got, MultiPlacement) and got.notes[0].startswith("1 of the nodes not in the fabric map yet")


def test_no_fit_still_says_why_per_node() -> None:
    fabric = fabric_places(INTERLEAVED, rails=1, group_size=4, spines=2)
    got = place_multi(Request(replica_id="big-x.1", gpus=8), 9, fleet(INTERLEAVED), PORTS, fabric)
    assert isinstance(got, NoFit) and "fabric ib: 8 of 9 nodes" in got.summary()


def test_real_sample_sdr_hcas_on_hdr_are_short_cables_named_by_switch() -> None:
    fabric = analyse(parse_topology((REAL / "ibnetdiscover" / "quantum-hdr-60sw-sdr-hca-links-crlf.txt").read_text()))
    short = sorted((node, device, place.short) for node, devices in places("f", fabric).items()
                   for device, place in devices.items() if place.short)
    assert [(node, device) for node, device, _ in short] == [("fit101", "HCA-1"), ("fit26", "HCA-3")]  # SOURCES.md
    assert all(text.startswith("cable to 0x") and "(Quantum Mellanox Technologies) trained 4xSDR" in text
               for _, _, text in short)
