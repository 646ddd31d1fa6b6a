"""The ibnetdiscover parsers on every real sample (tests/fixtures/real/SOURCES.md), with exact
counts on the small ones, each quirk the samples show, and arbitrary text."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.fabric.ibnetdiscover import parse_ibnetdiscover, parse_ports, parse_topology
from llmgw.fabric.topology import NodeKind, Topology, normalise_guid
from tests.realfixtures import REAL

DEFAULT = sorted((REAL / "ibnetdiscover").glob("*.txt"))
PORTS = sorted((REAL / "ibnetdiscover-ports").glob("*.txt"))


def read(name: str) -> str:
    return (REAL / name).read_text(encoding="utf-8")


def parse(name: str) -> Topology:
    return parse_topology(read(name))


def rates(topo: Topology) -> Counter[str]:
    return Counter(link.width + link.speed for link in topo.links)


def test_the_samples_are_all_here() -> None:
    assert len(DEFAULT) == 11 and len(PORTS) == 3


@pytest.mark.parametrize("path", DEFAULT + PORTS, ids=lambda p: p.name)
def test_every_real_sample_parses_into_a_map(path: Path) -> None:
    topo = parse_topology(path.read_text(encoding="utf-8"))
    assert topo.count(NodeKind.SWITCH) >= 1
    for link in topo.links:  # every link's ends are nodes of the map
        assert link.a.key in topo.nodes and link.b.key in topo.nodes
    assert len(topo.problems) <= 1  # only the prompt, the warning or `...omitted`


# ---- exact counts on the small samples ----------------------------------------------------------


def test_ibm_two_hcas_one_switch() -> None:
    topo = parse("ibnetdiscover/ibm-two-hca-one-switch-sdr.txt")
    assert (topo.count(NodeKind.SWITCH), topo.count(NodeKind.CA), len(topo.links)) == (1, 2, 2)
    assert rates(topo) == {"4xSDR": 2}
    switch = topo.nodes["0x000b8cffff0053ee"]
    assert (switch.description, switch.ports, switch.lid, switch.devid) == ("MT43132 Mellanox Technologies", 8, 3,
                                                                            "0xa87c")
    ca = topo.nodes["0x0002c902002789ac"]
    assert (ca.description, ca.lid) == ("compute-00-01 HCA-1", 1)
    assert topo.initiated_from == "0x0002c9030002847c"


def test_manpage_example_keeps_the_lower_rate_when_the_two_ends_disagree() -> None:
    """The man page's switch 0015 says its port 1 runs 1xSDR to 3080[10], 3080 says 4xSDR; CA 0558
    port 1 says 1xSDR, its switch 4xSDR. Each such link is kept once, at 1x."""
    topo = parse("ibnetdiscover/manpage-voltaire-sdr-1x-degraded.txt")
    assert (topo.count(NodeKind.SWITCH), topo.count(NodeKind.CA), len(topo.links)) == (2, 4, 7)
    assert rates(topo) == {"4xSDR": 5, "1xSDR": 2}
    slow = {(link.a.key, link.a.port, link.b.key, link.b.port) for link in topo.links if link.width == "1x"}
    assert slow == {
        ("0x0008f10400410015", 1, "0x005442ba00003080", 10),
        ("0x0008f10403960558", 1, "0x005442ba00003080", 12),
    }


def test_nvidia_kb_sample_stderr_line_and_self_loops() -> None:
    topo = parse("ibnetdiscover/nvidia-kb-switchib-sx6012-edr-fdr-qdr.txt")
    assert (topo.count(NodeKind.SWITCH), topo.count(NodeKind.CA), len(topo.links)) == (2, 6, 10)
    assert [(p.line, p.text[:20]) for p in topo.problems] == [(1, "src/query_smp.c:195;")]
    loops = sorted((link.a.port, link.b.port) for link in topo.links if link.self_loop)
    assert loops == [(1, 2), (19, 21), (29, 30)]  # printed from both ends, kept once each
    assert rates(topo) == {"4xEDR": 4, "4xFDR": 3, "4xQDR": 2, "4xSDR": 1}
    assert topo.nodes["0xf4521403005764b0"].description == "MF0;switch-de779e:SX6012/U1"


def test_oracle_sample_with_a_blank_line_of_one_space() -> None:
    topo = parse("ibnetdiscover/oracle-sun-dcs36-qdr.txt")
    assert (topo.count(NodeKind.SWITCH), topo.count(NodeKind.CA), len(topo.links), topo.problems) == (1, 1, 1, [])
    link = topo.links[0]
    assert {(link.a.key, link.a.port), (link.b.key, link.b.port)} == {
        ("0x0021283a8389a0a0", 23), ("0x0003ba000100e388", 2)}


def test_redacted_guids_are_told_apart_by_description() -> None:
    topo = parse("ibnetdiscover/ndr200-split-qm9700-2xndr-redacted-excerpt.txt")
    assert topo.redacted
    assert (topo.count(NodeKind.SWITCH), topo.count(NodeKind.CA), len(topo.links)) == (1, 5, 5)
    assert rates(topo) == {"2xNDR": 5}
    assert sorted(n.description for n in topo.nodes.values() if n.kind is NodeKind.CA) == [
        f"tj01-4090-node00{i} mlx5_2" for i in (4, 5, 6, 7, 9)]
    assert [(p.line, p.text) for p in topo.problems] == [(16, "...omitted")]


def test_x5_tabs_and_hash_inside_quoted_descriptions() -> None:
    topo = parse("ibnetdiscover/x5-psmn-voltaire-qdr-ddr.txt")
    assert (topo.count(NodeKind.SWITCH), topo.count(NodeKind.CA), len(topo.links), topo.problems) == (11, 89, 159, [])
    assert rates(topo) == {"4xQDR": 136, "4xDDR": 23}
    assert topo.nodes["0x0008f10500108c5c"].description == "Voltaire 4036 # 4036-8C5C"


def test_sx6036_fdr10_between_switches() -> None:
    topo = parse("ibnetdiscover/sx6036-8sw-144ca-qdr-fdr10-2014.txt")
    assert (topo.count(NodeKind.SWITCH), topo.count(NodeKind.CA), len(topo.links)) == (8, 144, 192)
    assert rates(topo) == {"4xQDR": 145, "4xFDR10": 47}


def test_crlf_sample() -> None:
    topo = parse("ibnetdiscover/quantum-hdr-60sw-sdr-hca-links-crlf.txt")
    assert (topo.count(NodeKind.SWITCH), topo.count(NodeKind.CA), topo.problems) == (60, 2, [])
    assert rates(topo) == {"4xHDR": 805, "4xSDR": 2}
    assert all("\r" not in n.description for n in topo.nodes.values())


def test_bom_and_shell_prompt_are_one_reported_line() -> None:
    topo = parse("ibnetdiscover/dgx-a100-superpod-hdr-206sw-sharp-an.txt")
    assert [p.line for p in topo.problems] == [1]
    assert "ibnetdiscover" in topo.problems[0].text and "\ufeff" not in topo.problems[0].text
    assert (topo.count(NodeKind.SWITCH), topo.count(NodeKind.CA), len(topo.links)) == (206, 1336, 3572)
    sharp = [n for n in topo.nodes.values() if n.description == "Mellanox Technologies Aggregation Node"]
    assert len(sharp) == 206


def test_ibdiagnet_variant_and_a_truncated_file() -> None:
    topo = parse("ibnetdiscover/ibdiagnet-cs8500-hdr-truncated.txt")
    assert topo.format == "ibdiagnet" and topo.problems == []
    assert all(n.seen for n in topo.nodes.values() if n.kind is NodeKind.SWITCH and n.ports)
    unseen = [n for n in topo.nodes.values() if not n.seen]
    assert unseen and all(n.kind is not NodeKind.SWITCH or not n.ports for n in unseen)
    # `[1](1) "H-88e9a4ffff0feec4"[1](88e9a4ffff0feec4)`: the (1) is a label, not a port GUID
    agpu = topo.nodes["0x88e9a4ffff0feec4"]
    assert (agpu.description, agpu.seen, agpu.lid) == ("agpu1421 HCA-2", False, 791)
    assert topo.nodes["0xb8cef60300617c9a"].devid == "0x000002c9" or topo.nodes["0xb8cef60300617c9a"].devid


def test_lassen_counts() -> None:
    topo = parse("ibnetdiscover/llnl-lassen-cs7500-edr-174sw.txt")
    assert (topo.count(NodeKind.SWITCH), topo.count(NodeKind.CA), len(topo.links), topo.problems) == (174, 1644, 3443,
                                                                                                      [])


# ---- -p -------------------------------------------------------------------------------------


def test_ports_format_connected_and_unconnected_ports() -> None:
    topo = parse("ibnetdiscover-ports/treydock-exporter-test.txt")
    assert topo.format == "ibnetdiscover-ports" and topo.problems == []
    assert (topo.count(NodeKind.SWITCH), topo.count(NodeKind.CA), len(topo.links)) == (4, 3, 4)
    assert rates(topo) == {"4xEDR": 4}
    assert topo.nodes["0x506b4b03005c2740"].description == "ib-i4l1s01"  # the unconnected port's line
    assert topo.nodes["0x08c0eb0300add20e"].description == "ib-i7l2s01"


def test_ports_format_strips_blanks_inside_quotes_and_reads_unquoted_names() -> None:
    topo = parse("ibnetdiscover-ports/treydock-exporter-test2.txt")
    assert topo.problems == []
    assert topo.nodes["0x946dae0300618c83"].description == "5FB0406-spine-IB02"
    assert topo.nodes["0x0002c9020040f160"].description == "Infiniscale-IV Mellanox Technologies"
    one = parse("ibnetdiscover-ports/treydock-exporter-test3.txt")
    assert one.problems == [] and one.count(NodeKind.SWITCH) == 1
    assert one.nodes["0x0002c9020040f161"].description == "Infiniscale-IV Mellanox Technologies"


def test_format_is_told_apart() -> None:
    assert parse_topology(read("ibnetdiscover-ports/treydock-exporter-test.txt")).format == "ibnetdiscover-ports"
    assert parse_topology(read("ibnetdiscover/oracle-sun-dcs36-qdr.txt")).format == "ibnetdiscover"


# ---- unreadable lines ------------------------------------------------------------------------


def test_a_line_it_cannot_read_is_reported_with_its_number_and_kept_out() -> None:
    text = read("ibnetdiscover/ibm-two-hca-one-switch-sdr.txt").splitlines()
    text.insert(11, "[3]     this is not a port line")
    text.insert(5, "ibwarn: [1234] mad_rpc: _do_madrpc failed; dport (DR path slid 0; dlid 0; 0,1)")
    topo = parse_ibnetdiscover("\n".join(text))
    assert [p.line for p in topo.problems] == [6, 13]
    assert (topo.count(NodeKind.SWITCH), topo.count(NodeKind.CA), len(topo.links)) == (1, 2, 2)


def test_port_lines_before_any_node_are_reported() -> None:
    topo = parse_ibnetdiscover('[1]\t"H-0002c902002789ac"[1](2c902002789ad)\t\t# "x HCA-1" lid 1 4xSDR\n')
    assert topo.nodes == {} and "outside any node block" in topo.problems[0].reason


def test_guid_spellings() -> None:
    assert normalise_guid("8f10403960559") == "0x0008f10403960559"
    assert normalise_guid("0x0008F10403960559") == "0x0008f10403960559"
    assert normalise_guid("b83f<redacted>") is None
    assert normalise_guid("12345678901234567") is None


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_arbitrary_text_never_raises(text: str) -> None:
    parse_topology(text)
    parse_ibnetdiscover(text)
    parse_ports(text)


LINE_PARTS = st.sampled_from([
    "Switch\t36 ", "Ca\t2 ", '"S-0008f10500200b50"', '"H-003048c749cd0000"', "[1]", "[12](1)", "(3048c749cd0001) ",
    '\t\t# "desc # x"', " lid 9", " lmc 0", " 4xQDR", " 12x???", " base port 0", "vendid=0x8f1", "\r", "\n", "\ufeff",
    "SW  1719 10 0x7cfe9003009ce5b0 4x EDR", " - CA   134  1 0x7cfe9003003b4bde", " ( 'a' - 'b' )", "9" * 30,
])


@settings(max_examples=300, deadline=None)
@given(st.lists(LINE_PARTS, max_size=40).map("".join))
def test_near_misses_of_the_format_never_raise(text: str) -> None:
    topo = parse_topology(text)
    for link in topo.links:
        assert link.a.key in topo.nodes and link.b.key in topo.nodes
