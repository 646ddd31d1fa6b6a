"""The self-healing decision (server/remedy.py): hysteresis, the clear window, the budget, the
operator's cordons, the modes. Pure: time is a number, readings are values; hypothesis drives
generated fleets through generated histories and checks the rules hold at every step."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.catalog.schema import RemedySettings, ServerConfig
from llmgw.catalog.units import dec_hook
from llmgw.doctor.facts import Finding, NodeFacts
from llmgw.doctor.node import NodeContext, check_gpu_health, check_nvlink
from llmgw.server.remedy import (
    AUTO_PREFIX,
    Cordon,
    Fault,
    GpuBack,
    GpuOut,
    MarkKind,
    Remedy,
    Report,
    Uncordon,
    budget,
    faults,
    mark_kind,
)
from llmgw.verdict import Status
from llmgw.wire import messages as m


def _settings(**kw: object) -> RemedySettings:
    base: dict[str, object] = {"auto_remediate": "act", "hold": 3, "clear_after": 60, "max_nodes": 2, "max_percent": 50}
    base.update(kw)
    return msgspec.convert(base, RemedySettings, dec_hook=dec_hook)


def xid(node: str, gpu: int, code: int = 79) -> Fault:
    return Fault(node=node, check="gpu-health", gpu=gpu, reason=f"gpu {gpu} Xid {code}")


def _apply(actions: list, marks: dict[str, MarkKind]) -> None:
    """What the control plane does with the marks (drain.py)."""
    for a in actions:
        if isinstance(a, Cordon):
            marks[a.node] = MarkKind.AUTO
        elif isinstance(a, Uncordon):
            assert marks.pop(a.node) == MarkKind.AUTO


# ---- from doctor's findings ------------------------------------------------------------------------


def _facts(gpus: list[m.GpuHealth], linked: bool = False) -> NodeFacts:
    inv = m.Inventory(gpus=[m.Gpu(index=h.index, name="H200", memory_mib=141000,
                                  nvlink={j.index: 18 for j in gpus if j.index != h.index} if linked else {})
                            for h in gpus], gpu_source="sim")
    return NodeFacts(id="n1", state="ready", inventory=inv, gpus=gpus)


def test_faults_from_the_real_gpu_checks() -> None:
    n = _facts([m.GpuHealth(index=0), m.GpuHealth(index=3, xid=79), m.GpuHealth(index=5, ecc_uncorrected=2),
                m.GpuHealth(index=6, xid=31), m.GpuHealth(index=7, health="lost", nvlink_down=2)], linked=True)
    found = check_gpu_health(n, NodeContext()) + check_nvlink(n, NodeContext())
    got = faults(found)
    by = {(f.gpu, f.check) for f in got}
    assert (3, "gpu-health") in by and (5, "gpu-health") in by and (7, "gpu-health") in by and (7, "nvlink") in by
    assert all(f.gpu != 6 for f in got)  # Xid 31 is a warning: nothing acts on it
    assert next(f for f in got if f.gpu == 3).reason == "gpu 3 Xid 79"
    assert all(f.gpu not in (0,) for f in got)


def test_node_checks_are_node_wide_and_others_ignored() -> None:
    found = [Finding(node="n1", check="disk", status=Status.CRIT, finding="2% free (x)"),
             Finding(node="n1", check="cert", status=Status.CRIT, finding="expires"),
             Finding(node="n1", check="gpu-health", status=Status.UNKNOWN, finding="?", subject="GPU 1")]
    got = faults(found, node_checks=["disk"])
    assert got == [Fault(node="n1", check="disk", gpu=None, reason="disk: 2% free")]


# ---- hysteresis and the clear window ---------------------------------------------------------------


def test_a_finding_must_hold_k_readings_and_the_gpu_is_out_at_once() -> None:
    r = Remedy(_settings(hold=3))
    marks: dict[str, MarkKind] = {}
    fleet = {"n1": 8, "n2": 8}
    r.observe("n1", [xid("n1", 3)], 0.0)
    first = r.decide(0.0, marks, fleet)
    assert first == [GpuOut(node="n1", gpu=3, reason="gpu 3 Xid 79")]
    assert r.unplaceable() == {"n1": {3: "gpu 3 Xid 79"}}
    r.observe("n1", [xid("n1", 3)], 5.0)
    assert r.decide(5.0, marks, fleet) == []
    r.observe("n1", [xid("n1", 3)], 10.0)
    assert r.decide(10.0, marks, fleet) == [Cordon(node="n1", reason="gpu 3 Xid 79", gpus=(3,), node_wide=False)]


def test_a_blip_cordons_nothing_and_its_gpu_returns_at_once() -> None:
    r = Remedy(_settings(hold=3))
    r.observe("n1", [xid("n1", 3)], 0.0)
    r.observe("n1", [xid("n1", 3)], 5.0)
    r.observe("n1", [], 10.0)
    actions = r.decide(10.0, {}, {"n1": 8})
    assert not any(isinstance(a, Cordon) for a in actions)
    assert r.unplaceable() == {}
    r.observe("n1", [xid("n1", 3)], 15.0)  # the streak starts over
    r.observe("n1", [xid("n1", 3)], 20.0)
    assert not any(isinstance(a, Cordon) for a in r.decide(20.0, {}, {"n1": 8}))


def test_uncordon_only_after_the_clear_window() -> None:
    r = Remedy(_settings(hold=1, clear_after=60))
    marks: dict[str, MarkKind] = {}
    fleet = {"n1": 8}
    r.observe("n1", [xid("n1", 3)], 0.0)
    _apply(r.decide(0.0, marks, fleet), marks)
    assert marks == {"n1": MarkKind.AUTO}
    r.observe("n1", [], 10.0)
    r.observe("n1", [], 40.0)
    assert r.decide(40.0, marks, fleet) == []
    assert r.unplaceable() == {"n1": {3: "gpu 3 Xid 79"}}  # still out: not clear long enough
    r.observe("n1", [xid("n1", 3)], 50.0)  # back again: the window starts over
    r.observe("n1", [], 60.0)
    r.observe("n1", [], 100.0)
    assert r.decide(100.0, marks, fleet) == []
    r.observe("n1", [], 120.0)
    actions = r.decide(120.0, marks, fleet)
    assert GpuBack(node="n1", gpu=3, reason="clear (was gpu 3 Xid 79)") in actions
    assert any(isinstance(a, Uncordon) and a.node == "n1" for a in actions)


def test_an_auto_mark_without_readings_stays() -> None:
    """After a restart the history is gone: a node auto-cordoned before waits for clean readings."""
    r = Remedy(_settings(clear_after=60))
    assert r.decide(1000.0, {"n1": MarkKind.AUTO}, {"n1": 8}) == []
    r.observe("n1", [], 1000.0)
    assert r.decide(1059.0, {"n1": MarkKind.AUTO}, {"n1": 8}) == []
    r.observe("n1", [], 1060.0)
    assert r.decide(1060.0, {"n1": MarkKind.AUTO}, {"n1": 8})[0] == Uncordon(
        node="n1", reason="readings clear for 60s (clear_after 60s)")


# ---- the operator, the budget, the modes -------------------------------------------------------------


def test_an_operator_cordon_is_never_lifted_nor_taken_over() -> None:
    r = Remedy(_settings(hold=1, clear_after=1))
    r.observe("n1", [xid("n1", 3)], 0.0)
    actions = r.decide(0.0, {"n1": MarkKind.OPERATOR}, {"n1": 8})
    assert [type(a) for a in actions] == [GpuOut, Report]
    assert "operator" in actions[1].why
    assert r.decide(1.0, {"n1": MarkKind.OPERATOR}, {"n1": 8}) == []  # reported once
    r.observe("n1", [], 2.0)
    r.observe("n1", [], 100.0)
    assert not any(isinstance(a, Uncordon) for a in r.decide(100.0, {"n1": MarkKind.OPERATOR}, {"n1": 8}))


def test_past_the_budget_findings_are_reported_only() -> None:
    r = Remedy(_settings(hold=1, max_nodes=2, max_percent=100))
    fleet = {f"n{i}": 8 for i in range(5)}
    marks: dict[str, MarkKind] = {}
    for node in fleet:
        r.observe(node, [xid(node, 0)], 0.0)
    actions = r.decide(0.0, marks, fleet)
    _apply(actions, marks)
    assert sorted(a.node for a in actions if isinstance(a, Cordon)) == ["n0", "n1"]
    assert sorted(a.node for a in actions if isinstance(a, Report)) == ["n2", "n3", "n4"]
    assert all("budget" in a.why for a in actions if isinstance(a, Report))
    assert r.decide(1.0, marks, fleet) == []


def test_budget_by_share_of_the_fleet() -> None:
    assert budget(_settings(max_nodes=10, max_percent=10), 100) == 10
    assert budget(_settings(max_nodes=10, max_percent=10), 35) == 3
    assert budget(_settings(max_nodes=10, max_percent=10), 3) == 1  # at least one
    assert budget(_settings(max_nodes=0, max_percent=10), 100) == 0
    assert budget(_settings(max_nodes=5, max_percent=10), 0) == 0


def test_report_mode_cordons_nothing_but_takes_the_gpu_out() -> None:
    r = Remedy(_settings(auto_remediate="report", hold=1))
    r.observe("n1", [xid("n1", 2)], 0.0)
    actions = r.decide(0.0, {}, {"n1": 8})
    assert [type(a) for a in actions] == [GpuOut, Report]
    assert "auto_remediate: report" in actions[1].why


def test_off_does_nothing() -> None:
    r = Remedy(_settings(auto_remediate="off", hold=1))
    r.observe("n1", [xid("n1", 2)], 0.0)
    assert r.decide(0.0, {}, {"n1": 8}) == [] and r.unplaceable() == {}


def test_node_wide_when_every_gpu_or_a_node_check() -> None:
    r = Remedy(_settings(hold=1))
    r.observe("n1", [xid("n1", 0), xid("n1", 1)], 0.0)
    r.observe("n2", [Fault(node="n2", check="disk", gpu=None, reason="disk: full")], 0.0)
    actions = r.decide(0.0, {}, {"n1": 2, "n2": 8, "n3": 8, "n4": 8})
    cordons = {a.node: a for a in actions if isinstance(a, Cordon)}
    assert cordons["n1"].node_wide and cordons["n1"].gpus == (0, 1)
    assert cordons["n1"].reason == "gpu 0 Xid 79 (+1 more)"
    assert cordons["n2"].node_wide and cordons["n2"].gpus == ()


def test_config_defaults_and_off() -> None:
    cfg = ServerConfig()
    assert cfg.remedy.mode == "report" and cfg.remedy.hold == 3 and cfg.remedy.clear_after == 600
    assert msgspec.convert({"auto_remediate": False}, RemedySettings, dec_hook=dec_hook).mode == "off"
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"auto_remediate": True}, RemedySettings, dec_hook=dec_hook)
    assert mark_kind(AUTO_PREFIX + "gpu 3 Xid 79") == MarkKind.AUTO and mark_kind("admin") == MarkKind.OPERATOR


# ---- generated fleets ---------------------------------------------------------------------------------

NODES = [f"n{i}" for i in range(6)]
reading = st.tuples(st.sampled_from(NODES), st.sets(st.integers(0, 3), max_size=3))
step = st.one_of(
    st.tuples(st.just("read"), reading, st.floats(0.5, 40.0)),
    st.tuples(st.just("operator-cordon"), st.sampled_from(NODES), st.just(0.0)),
    st.tuples(st.just("operator-uncordon"), st.sampled_from(NODES), st.just(0.0)),
)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(step, max_size=60), hold=st.integers(1, 4), clear_after=st.floats(1.0, 100.0),
       max_nodes=st.integers(0, 4), max_percent=st.floats(0, 100), mode=st.sampled_from(["report", "act"]))
def test_the_rules_hold_in_generated_histories(steps: list, hold: int, clear_after: float, max_nodes: int,
                                               max_percent: float, mode: str) -> None:
    s = _settings(auto_remediate=mode, hold=hold, clear_after=clear_after, max_nodes=max_nodes,
                  max_percent=max_percent)
    r = Remedy(s)
    fleet = {n: 4 for n in NODES}
    marks: dict[str, MarkKind] = {}
    now = 0.0
    history: dict[str, list[tuple[float, bool]]] = {n: [] for n in NODES}  # (time, faulty) per reading
    operator: set[str] = set()
    for kind, arg, dt in steps:
        now += dt
        if kind == "read":
            node, gpus = arg
            r.observe(node, [xid(node, g) for g in sorted(gpus)], now)
            history[node].append((now, bool(gpus)))
        elif kind == "operator-cordon":
            marks[arg] = MarkKind.OPERATOR
            operator.add(arg)
        elif arg in operator:
            marks.pop(arg, None)
            operator.discard(arg)
        before = dict(marks)
        actions = r.decide(now, marks, fleet)
        for a in actions:
            if isinstance(a, Cordon):
                assert mode == "act"
                assert a.node not in before  # never takes over a mark
                readings = history[a.node]
                # K consecutive faulty readings happened at some point
                run = best = 0
                for _, faulty in readings:
                    run = run + 1 if faulty else 0
                    best = max(best, run)
                assert best >= hold
            if isinstance(a, Uncordon):
                assert before.get(a.node) == MarkKind.AUTO  # never an operator's
                readings = history[a.node]
                last_faulty = max((t for t, f in readings if f), default=None)
                clean = [t for t, f in readings if not f and (last_faulty is None or t > last_faulty)]
                assert clean and now - clean[0] >= clear_after
        _apply(actions, marks)
        auto = sum(1 for k in marks.values() if k == MarkKind.AUTO)
        cordoned_now = sum(1 for a in actions if isinstance(a, Cordon))
        if cordoned_now:
            assert auto <= budget(s, len(fleet))
        # the same inputs again: nothing new
        assert r.decide(now, marks, fleet) == []
        # a GPU faulty in a node's latest reading is never placeable
        for node, readings in history.items():
            if readings and readings[-1][1]:
                assert node in r.unplaceable()


# ---- health feeds placement ---------------------------------------------------------------------------


def test_an_unplaceable_gpu_is_skipped_and_named_in_why_nothing_fits() -> None:
    from llmgw.placement.single import NodeCapacity, NoFit, Placement, Request, place

    gpus = [m.Gpu(index=i, name="H200", memory_mib=141000) for i in range(2)]
    node = NodeCapacity(node_id="n1", state="ready", gpus=gpus, unplaceable={0: "gpu 0 Xid 79"})
    got = place(Request(replica_id="r1", gpus=1), [node], (20000, 20010))
    assert isinstance(got, Placement) and got.gpus == (1,)
    got = place(Request(replica_id="r1", gpus=2), [node], (20000, 20010))
    assert isinstance(got, NoFit)
    assert got.summary() == "n1: only 1 of 2 matching GPUs are healthy, 2 needed (not placeable: gpu 0 Xid 79)"


def test_the_board_checks_crits_take_their_gpu_out_as_the_health_checks_do():
    """Issue 39's per-GPU checks (row remapping, temperature, the NVSwitch fabric) act like Xid 79."""
    from llmgw.doctor.facts import Finding
    from llmgw.server.remedy import faults
    from llmgw.verdict import Status

    found = [Finding(node="n1", check=check, status=Status.CRIT, finding="x", subject="GPU 2")
             for check in ("row-remap", "temperature", "fabric-manager", "clocks")]
    got = faults(found)
    assert sorted(f.check for f in got) == ["fabric-manager", "row-remap", "temperature"]
    assert all(f.gpu == 2 for f in got)
