"""Subnet managers and fabric identity: the SMIR parser (built from saquery.c), the real sminfo
sample, and fabrics grouped across failovers, missing standbys and disagreeing ports."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.fabric.subnet import (
    FabricProblemKind,
    MasterChange,
    PortView,
    SmRecord,
    SmState,
    group_fabrics,
    master_changes,
    parse_sm_text,
    parse_sminfo,
    parse_smir,
    remember,
)
from llmgw.sim.fabric import FabricSpec, generate
from tests.realfixtures import REAL

WRITTEN = Path(__file__).resolve().parents[1] / "fixtures" / "written"


def test_smir_as_saquery_prints_it() -> None:
    parsed = parse_smir((WRITTEN / "saquery-smir-master-standby.txt").read_text())
    assert parsed.problems == []
    assert parsed.records == [
        SmRecord(guid="0x0002c90300a1b2c0", lid=1, priority=15, state=SmState.MASTER, act_count=48213),
        SmRecord(guid="0x0002c90300a1b3f0", lid=7, priority=14, state=SmState.STANDBY, act_count=48190),
    ]


def test_smir_record_cut_short_is_reported_not_kept() -> None:
    parsed = parse_smir((WRITTEN / "saquery-smir-cut-short.txt").read_text())
    assert [r.guid for r in parsed.records] == ["0x0002c90300a1b2c0"]
    assert [(p.line, p.reason[:20]) for p in parsed.problems] == [
        (10, "a record without a G"), (15, "not `saquery SMIR` o")]


def test_real_sminfo_wrapped_by_a_mail_client() -> None:
    text = (REAL / "sminfo" / "ompi-users-2008-c3-cexec-4nodes-mail-wrapped.txt").read_text()
    parsed = parse_sm_text(text)
    assert parsed.problems == []
    assert {(r.guid, r.lid, r.priority, r.state) for r in parsed.records} == {
        ("0x0002c90200259201", 2, 0, SmState.MASTER)}
    assert [r.act_count for r in parsed.records] == [6881, 6882, 6883, 6884]


def test_sminfo_one_line() -> None:
    parsed = parse_sminfo("sminfo: sm lid 1 sm guid 0x248a0703005abf1c, activity count 1234 priority 14 state 2 "
                          "SMINFO_STANDBY\n")
    assert parsed.records == [SmRecord(guid="0x248a0703005abf1c", lid=1, priority=14, state=SmState.STANDBY,
                                       act_count=1234)]


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_arbitrary_text_never_raises(text: str) -> None:
    parse_smir(text)
    parse_sminfo(text)
    parse_sm_text("SMInfoRecord dump:\n" + text)


# ---- identity ------------------------------------------------------------------------------------

A, B, C, D = "0x0000000000000a01", "0x0000000000000b02", "0x0000000000000c03", "0x0000000000000d04"


def rec(guid: str, state: SmState, priority: int = 0, count: int = 0) -> SmRecord:
    return SmRecord(guid=guid, state=state, priority=priority, act_count=count)


def view(node: str, *records: SmRecord, state: str = "ACTIVE", sm_lid: int = 1) -> PortView:
    return PortView(node=node, port="mlx5_0/1", state=state, sm_lid=sm_lid, records=records)


def sim_views(**kw: object) -> list[PortView]:
    fabric = generate(FabricSpec(nodes=["n1", "n2", "n3"], rails=2, group_size=3, spines=2, **kw))  # type: ignore[arg-type]
    records = tuple(parse_smir(fabric.smir).records)
    return [view(n, *records) for n in ("n1", "n2", "n3")]


def test_sms_listed_together_are_one_fabric_named_by_the_lowest_guid() -> None:
    report = group_fabrics([view("n1", rec(B, SmState.MASTER, 14), rec(A, SmState.STANDBY, 13)),
                            view("n2", rec(C, SmState.MASTER)),
                            view("n3", rec(C, SmState.MASTER), rec(D, SmState.STANDBY))])
    assert [(f.id, f.master.guid if f.master else None, [s.guid for s in f.standbys]) for f in report.fabrics] == [
        (A, B, [A]), (C, C, [D])]


def test_a_failover_on_a_generated_fabric_does_not_split_it() -> None:
    before = group_fabrics(sim_views())
    assert len(before.fabrics) == 1 and before.fabrics[0].problems == []
    (fabric,) = before.fabrics
    known = remember(before, {})
    first_master = fabric.master.guid if fabric.master else ""
    assert fabric.id == first_master  # the lowest GUID was master

    after = group_fabrics(sim_views(failover=True), known=known)
    assert [f.id for f in after.fabrics] == [fabric.id]  # the old master is gone; the name stays
    assert after.fabrics[0].master is not None and after.fabrics[0].master.guid != first_master
    changes = master_changes({fabric.id: first_master}, after, now=1000.0)
    assert [(c.fabric, c.old) for c in changes] == [(fabric.id, first_master)]
    # the new master alone, without the server's memory, would have read as another fabric
    assert group_fabrics(sim_views(failover=True)).fabrics[0].id != fabric.id

    again = group_fabrics(sim_views(failover=True), known=known, changes=changes, now=1000.0 + 1800)
    kinds = {p.kind for p in again.fabrics[0].problems}
    assert kinds == {FabricProblemKind.MASTER_CHANGED, FabricProblemKind.NO_STANDBY}
    later = group_fabrics(sim_views(failover=True), known=known, changes=changes, now=1000.0 + 3601)
    assert {p.kind for p in later.fabrics[0].problems} == {FabricProblemKind.NO_STANDBY}


def test_no_standby() -> None:
    report = group_fabrics(sim_views(no_standby=True))
    assert [p.kind for p in report.fabrics[0].problems] == [FabricProblemKind.NO_STANDBY]


def test_ports_disagree_on_the_master() -> None:
    report = group_fabrics([view("n1", rec(A, SmState.MASTER), rec(B, SmState.STANDBY)),
                            view("n2", rec(A, SmState.MASTER), rec(B, SmState.STANDBY)),
                            view("n3", rec(B, SmState.MASTER), rec(A, SmState.STANDBY))])
    (fabric,) = report.fabrics
    assert fabric.master is not None and fabric.master.guid == A  # most ports say so
    assert [p.kind for p in fabric.problems] == [FabricProblemKind.SM_DISAGREE]
    assert "n3/mlx5_0/1" in fabric.problems[0].message


def test_ports_up_with_no_subnet_manager() -> None:
    report = group_fabrics([view("n1", rec(A, SmState.MASTER), rec(B, SmState.STANDBY)),
                            view("n2", state="INIT", sm_lid=0)])
    assert report.unmanaged == ["n2/mlx5_0/1"]
    assert [p.kind for p in report.problems] == [FabricProblemKind.NO_SM]


def test_a_master_change_older_than_an_hour_is_history_not_a_problem() -> None:
    change = MasterChange(fabric=A, at=0.0, old=A, new=B)
    views = [view("n1", rec(B, SmState.MASTER), rec(A, SmState.STANDBY))]
    assert FabricProblemKind.MASTER_CHANGED in {p.kind for p in group_fabrics(views, changes=[change],
                                                                              now=10).fabrics[0].problems}
    assert group_fabrics(views, changes=[change], now=7200).fabrics[0].problems == []
