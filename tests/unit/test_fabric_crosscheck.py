"""The map one node's dump makes, held against what each node reads of its own ports (issue 40,
finding 10): a dump cannot mark another node's cable degraded, and a disagreement is said."""

from __future__ import annotations

from pathlib import Path

from llmgw.fabric.analysis import FabricMap, LinkInfo, LinkKind, ProblemKind, analyse
from llmgw.fabric.crosscheck import OwnPort, cross_check
from llmgw.fabric.ibnetdiscover import parse_topology
from llmgw.fabric.topology import NodeKind

REAL = Path(__file__).parent.parent / "fixtures" / "real" / "ibnetdiscover"
# PSMN's X5 cluster (SOURCES.md): 4xDDR host cables among 4xQDR ones, a real degraded-host fabric.
PSMN = REAL / "x5-psmn-voltaire-qdr-ddr.txt"


def real_map() -> FabricMap:
    return analyse(parse_topology(PSMN.read_text()))


def adapter_end(link: LinkInfo) -> tuple[str, int]:
    end = link.b if link.a.kind is NodeKind.SWITCH else link.a
    return end.guid, end.port


def reading(rate: float, phys_state: str = "LinkUp", state: str = "ACTIVE") -> OwnPort:
    return OwnPort(node="x5-7", device="mlx4_0", port=1, state=state, phys_state=phys_state, rate_gbps=rate)


def test_a_cable_the_dump_calls_short_but_its_node_reads_at_full_rate_is_not_degraded() -> None:
    fmap = real_map()
    short = next(link for link in fmap.links if link.degraded and link.kind is LinkKind.HOST)
    assert short.rate_gbps == 20.0  # 4xDDR where the host norm is 4xQDR (40 Gb/s)
    checked = cross_check(fmap, {adapter_end(short): reading(40.0)}, "x5-1/mlx4_0/1")
    same = next(link for link in checked.links if adapter_end(link) == adapter_end(short))
    assert not same.degraded and same.reason == ""
    assert checked.summary.degraded_links == fmap.summary.degraded_links - 1
    said = [p.message for p in checked.problems if p.kind is ProblemKind.MAP_DISAGREES]
    assert said == ["the dump from x5-1/mlx4_0/1 has the cable at x5-7 mlx4_0/1 at 20 Gb/s (4xDDR); x5-7 reads "
                    "40 Gb/s: the node's own reading is used"]
    degraded_said = [p for p in checked.problems if p.kind is ProblemKind.DEGRADED_LINK]
    assert len(degraded_said) == checked.summary.degraded_links  # the problem list follows the links


def test_a_node_that_reads_its_cable_short_too_keeps_it_degraded_and_nothing_disagrees() -> None:
    fmap = real_map()
    short = next(link for link in fmap.links if link.degraded and link.kind is LinkKind.HOST)
    checked = cross_check(fmap, {adapter_end(short): reading(20.0)}, "x5-1/mlx4_0/1")
    assert checked == fmap


def test_a_cable_the_dump_calls_healthy_that_its_node_reads_short_is_degraded_in_the_nodes_words() -> None:
    fmap = real_map()
    good = next(link for link in fmap.links if not link.degraded and link.kind is LinkKind.HOST)
    checked = cross_check(fmap, {adapter_end(good): reading(10.0)}, "x5-1/mlx4_0/1")
    same = next(link for link in checked.links if adapter_end(link) == adapter_end(good))
    assert same.degraded and same.reason == "x5-7 reads its port at 10 Gb/s where 40 is the norm"
    assert checked.summary.degraded_links == fmap.summary.degraded_links + 1


def test_a_cable_at_a_port_its_node_reads_without_a_link_is_said_and_kept() -> None:
    fmap = real_map()
    good = next(link for link in fmap.links if not link.degraded and link.kind is LinkKind.HOST)
    checked = cross_check(fmap, {adapter_end(good): reading(40.0, "Polling", "DOWN")}, "x5-1/mlx4_0/1")
    assert checked.links == fmap.links
    (said,) = [p.message for p in checked.problems if p.kind is ProblemKind.MAP_DISAGREES]
    assert said == "the dump from x5-1/mlx4_0/1 shows a cable at x5-7 mlx4_0/1; x5-7 reads the port as DOWN (Polling)"
    # A real mlx4 board prints `4: ACTIVE` in phys_state (SOURCES.md): that is no disagreement.
    assert cross_check(fmap, {adapter_end(good): reading(40.0, "ACTIVE")}, "x5-1/mlx4_0/1") == fmap


def test_ports_no_node_reads_leave_the_map_as_the_dump_has_it() -> None:
    fmap = real_map()
    assert cross_check(fmap, {}, "x5-1/mlx4_0/1") is fmap
    short = next(link for link in fmap.links if link.degraded and link.kind is LinkKind.HOST)
    assert cross_check(fmap, {adapter_end(short): reading(0.0)}, "x5-1/mlx4_0/1") == fmap  # rate not read
