"""Tiers, adapters, degraded cables and rails: on the real samples where their notes in
SOURCES.md say what is there, and on fabrics `llmgw sim fabric` generates, where we know."""

from __future__ import annotations

import re

import pytest

from llmgw.fabric.analysis import FabricMap, ProblemKind, analyse, host_of
from llmgw.fabric.ibnetdiscover import parse_topology
from llmgw.sim.fabric import FabricSpec, generate
from llmgw.sim.node import node_guid
from tests.realfixtures import REAL


def real(name: str) -> FabricMap:
    return analyse(parse_topology((REAL / "ibnetdiscover" / name).read_text(encoding="utf-8")))


def sim(**kw: object) -> FabricMap:
    nodes = kw.pop("nodes", 8)
    assert isinstance(nodes, int)
    spec = FabricSpec(nodes=[f"node-{i}" for i in range(1, nodes + 1)], **kw)  # type: ignore[arg-type]
    return analyse(parse_topology(generate(spec).ibnetdiscover))


def degraded(fabric: FabricMap) -> list[tuple[str, str]]:
    return sorted((f"{link.a.name}[{link.a.port}]", f"{link.b.name}[{link.b.port}]")
                  for link in fabric.links if link.degraded)


# ---- degraded cables where SOURCES.md says they are ---------------------------------------------


def test_manpage_1x_links_are_degraded() -> None:
    fabric = real("manpage-voltaire-sdr-1x-degraded.txt")
    assert degraded(fabric) == [
        ("MT23108 InfiniHost Mellanox Technologies[1]", "ISR9024 Voltaire[12]"),
        ("SW-6IB4 Voltaire[1]", "ISR9024 Voltaire[10]"),
    ]
    assert all("1x where 4x is the norm" in link.reason for link in fabric.links if link.degraded)


def test_x5_ddr_hosts_among_qdr_are_degraded() -> None:
    fabric = real("x5-psmn-voltaire-qdr-ddr.txt")
    slow = [link for link in fabric.links if link.degraded]
    assert len(slow) == 23 and all(link.speed == "DDR" and link.kind == "host" for link in slow)
    assert fabric.summary.degraded_links == 23


def test_nvidia_kb_only_the_sdr_hca_is_degraded() -> None:
    fabric = real("nvidia-kb-switchib-sx6012-edr-fdr-qdr.txt")
    assert degraded(fabric) == [("r-ufm96 HCA-1[1]", "MF0;switch-de779e:SX6012/U1[8]")]


def test_quantum_sdr_hcas_on_an_hdr_fabric_are_degraded() -> None:
    fabric = real("quantum-hdr-60sw-sdr-hca-links-crlf.txt")
    assert sorted(a for a, _ in degraded(fabric)) == ["fit101 HCA-1[1]", "fit26 HCA-3[1]"]


@pytest.mark.parametrize("name", [
    "ibm-two-hca-one-switch-sdr.txt", "oracle-sun-dcs36-qdr.txt", "ndr200-split-qm9700-2xndr-redacted-excerpt.txt",
    "sx6036-8sw-144ca-qdr-fdr10-2014.txt", "dgx-a100-superpod-hdr-206sw-sharp-an.txt",
    "llnl-lassen-cs7500-edr-174sw.txt",
])
def test_uniform_fabrics_have_no_degraded_cables(name: str) -> None:
    assert real(name).summary.degraded_links == 0


# ---- tiers, adapters ---------------------------------------------------------------------------


def test_dgx_superpod_tiers_and_sharp_nodes_are_not_hosts() -> None:
    fabric = real("dgx-a100-superpod-hdr-206sw-sharp-an.txt")
    assert fabric.summary.aggregation_nodes == 206
    assert fabric.summary.adapters == 1336 - 206
    tiers: dict[str, set[str]] = {s.description[:2]: set() for s in fabric.switches}
    for s in fabric.switches:
        tiers[s.description[:2]].add(s.tier)
    assert tiers["lf"] == {"leaf"}  # every `lf…` switch is a leaf
    # sp79 and sp80 carry the management hosts (UFM, login, provisioning): leaves by distance
    assert sorted(s.description[:4] for s in fabric.switches if s.description.startswith("sp") and s.tier == "leaf") \
        == ["sp79", "sp80"]
    assert tiers["ss"] == {"spine", "core"}


def test_lassen_is_three_tiers() -> None:
    fabric = real("llnl-lassen-cs7500-edr-174sw.txt")
    by_name = {s.guid: s for s in fabric.switches}
    assert fabric.summary.tiers == {"leaf": 84, "spine": 54, "core": 36}
    spines = [s for s in by_name.values() if "/S" in s.description]
    assert len(spines) == 36 and {s.tier for s in spines} == {"core"}  # the directors' spine ASICs


def test_node_descriptions() -> None:
    assert host_of("stage114 mlx4_0") == ("stage114", "mlx4_0")
    assert host_of("compute-00-01 HCA-1") == ("compute-00-01", "HCA-1")
    assert host_of("MT25408 ConnectX Mellanox Technologies") == (None, "")
    assert host_of("Mellanox Technologies Aggregation Node") == (None, "")
    assert host_of("r-ufm96") == ("r-ufm96", "")


def test_the_agents_guids_win_over_descriptions() -> None:
    topo = parse_topology((REAL / "ibnetdiscover" / "x5-psmn-voltaire-qdr-ddr.txt").read_text())
    assert all(a.node is None for a in analyse(topo).adapters)  # firmware-default descriptions
    fabric = analyse(topo, known={"0x003048c749cd0000": ("x5-node-7", "mlx4_0"),
                                  "0x0003048c749bb0001": ("never", "used")})
    named = {a.guid: (a.node, a.device) for a in fabric.adapters if a.node}
    assert named == {"0x003048c749cd0000": ("x5-node-7", "mlx4_0")}
    # a port GUID the agent knows names the adapter too
    by_port = analyse(topo, known={"0x003048c749bb0001": ("x5-node-8", "mlx4_0")})
    assert {a.node for a in by_port.adapters if a.node} == {"x5-node-8"}


# ---- generated fabrics ---------------------------------------------------------------------------


def test_two_tier_generated_fabric() -> None:
    fabric = sim(nodes=8, rails=4, group_size=4, spines=2)
    assert fabric.summary.tiers == {"leaf": 8, "spine": 2}
    assert fabric.summary.adapters == 32 and fabric.summary.links == 32 + 8 * 2
    assert fabric.summary.rail_optimised and fabric.rail_violations == [] and fabric.summary.degraded_links == 0
    assert len(fabric.rails) == 8 and {r.rail for r in fabric.rails} == {"mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"}
    assert all(len(r.leaves) == 1 and r.adapters == 4 for r in fabric.rails)
    # the adapters are the simulated nodes' own
    assert {(a.node, a.device, a.guid) for a in fabric.adapters} >= {("node-3", "mlx5_2",
                                                                      f"0x{node_guid('node-3', 2):016x}")}


def test_three_tier_generated_fabric() -> None:
    fabric = sim(nodes=64, rails=8, group_size=8, spines=2, core=3, groups_per_pod=2)
    assert fabric.summary.tiers == {"leaf": 64, "spine": 8, "core": 3}
    assert fabric.summary.rail_optimised and fabric.rail_violations == []
    assert len({r.group for r in fabric.rails}) == 8


def test_a_broken_rail_names_node_adapter_and_both_leaves() -> None:
    fabric = sim(nodes=8, rails=4, group_size=4, spines=2, misrail=["node-6"])
    names = {s.guid: s.description for s in fabric.switches}
    got = [(v.node, v.adapter, names[v.leaf], names[v.rail_leaf]) for v in fabric.rail_violations]
    assert got == [
        ("node-6", "mlx5_0", "MF0;leaf-g2-r1:MQM9700/U1", "MF0;leaf-g2-r0:MQM9700/U1"),
        ("node-6", "mlx5_1", "MF0;leaf-g2-r0:MQM9700/U1", "MF0;leaf-g2-r1:MQM9700/U1"),
    ]
    assert [p.kind for p in fabric.problems] == [ProblemKind.RAIL_VIOLATION] * 2


def test_degraded_host_cable_and_uplink_below_its_siblings() -> None:
    fabric = sim(nodes=8, rails=4, group_size=4, spines=2, degraded=["node-2", "node-7:mlx5_0"], degraded_uplinks=1)
    slow = {(link.kind, link.width) for link in fabric.links if link.degraded}
    assert slow == {("host", "1x"), ("switch", "1x")}
    hosts = sorted(link.b.name if link.b.kind == "ca" else link.a.name
                   for link in fabric.links if link.degraded and link.kind == "host")
    assert hosts == ["node-2 mlx5_3", "node-7 mlx5_0"]


def test_parallel_inter_switch_link_below_its_siblings() -> None:
    """Three cables between the same two switches, two at 2x: the inter-switch norm is then 2x, but
    the 4x sibling shows what the pair can run at."""
    text = generate(FabricSpec(nodes=["n1", "n2"], rails=1, group_size=2, spines=1)).ibnetdiscover
    topo = parse_topology(text)
    isl = next(link for link in topo.links if topo.nodes[link.a.key].kind == topo.nodes[link.b.key].kind)
    for port in (98, 99):
        topo.links.append(type(isl)(a=type(isl.a)(isl.a.key, port), b=type(isl.b)(isl.b.key, port),
                                    width="2x", speed=isl.speed))
    fabric = analyse(topo)
    reasons = [link.reason for link in fabric.links if link.degraded]
    assert reasons == [f"2x{isl.speed} where 2 parallel links run up to 4x{isl.speed}"] * 2


def test_one_adapter_per_node_is_not_a_rail_fabric() -> None:
    fabric = sim(nodes=8, rails=1, group_size=4, spines=2)
    assert not fabric.summary.rail_optimised and fabric.rails == [] and fabric.rail_violations == []


def test_multi_adapter_nodes_cabled_in_pairs_are_not_a_rail_fabric() -> None:
    # Four 4-adapter nodes, each adapter pair on one leaf (mlx5_0+1 of n1 and n2 on one leaf,
    # of n3 and n4 on another, mlx5_2+3 likewise): the leaves' most common devices differ
    # (mlx5_0 on two, mlx5_2 on two), yet only half the adapters sit on "their" leaf, under
    # RAIL_FIT: not rail-optimised, so no rails and no violations to chase (issue 37).
    text = generate(FabricSpec(nodes=["n1", "n2", "n3", "n4"], rails=4, group_size=4, spines=2)).ibnetdiscover

    def recable(match: re.Match[str]) -> str:  # the adapter on leaf r<k>, port of node j, gets a new name
        j, k = int(match[1]), int(match[2])
        index = (k % 2) * 4 + (j - 1)
        return f'"n{index // 2 + 1} mlx5_{(k // 2) * 2 + index % 2}"'

    fabric = analyse(parse_topology(re.sub(r'"n(\d) mlx5_(\d)"', recable, text)))
    on_leaf: dict[str, set[str]] = {}
    for link in fabric.links:
        if link.b.name.startswith("n"):
            on_leaf.setdefault(link.a.name, set()).add(link.b.name)
    assert sorted(map(sorted, on_leaf.values()))[0] == ["n1 mlx5_0", "n1 mlx5_1", "n2 mlx5_0", "n2 mlx5_1"], on_leaf
    assert not fabric.summary.rail_optimised and fabric.rails == [] and fabric.rail_violations == []


def test_a_two_rail_node_with_both_adapters_swapped_is_told_its_rails_leaves() -> None:
    # issue 38, item 7: every adapter of the node is off its rail, so none places the node in a
    # group; the advice comes from the group of the leaves it is cabled to, which carry the rails.
    fabric = sim(nodes=8, rails=2, group_size=4, spines=2, misrail=["node-6"])
    names = {s.guid: s.description for s in fabric.switches}
    got = [(v.node, v.adapter, names[v.leaf], names.get(v.rail_leaf, "")) for v in fabric.rail_violations]
    assert got == [
        ("node-6", "mlx5_0", "MF0;leaf-g2-r1:MQM9700/U1", "MF0;leaf-g2-r0:MQM9700/U1"),
        ("node-6", "mlx5_1", "MF0;leaf-g2-r0:MQM9700/U1", "MF0;leaf-g2-r1:MQM9700/U1"),
    ]
    assert all("no leaf carries" not in p.message for p in fabric.problems)


def test_rails_are_judged_among_nodes_that_look_alike() -> None:
    # issue 38, item 7: a host whose adapters are named another way (a UFM host's `HCA-1`, a box
    # whose PCI order differs) is not held to the mlx5_N nodes' rail order: it is listed apart.
    spec = FabricSpec(nodes=[f"node-{i}" for i in range(1, 9)], rails=2, group_size=4, spines=2, misrail=["node-6"])
    text = generate(spec).ibnetdiscover
    text = text.replace('"node-6 mlx5_0"', '"node-6 HCA-1"').replace('"node-6 mlx5_1"', '"node-6 HCA-2"')
    fabric = analyse(parse_topology(text))
    assert fabric.summary.rail_optimised
    assert fabric.rail_violations == []
    assert fabric.rails_apart == ["node-6"]
