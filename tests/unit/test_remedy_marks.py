"""The system's own cordons in the drain marks (drain.Drainer.auto_cordon / auto_uncordon) and the
service's grading (server/remedy_service.py `grade`, a worker thread's pure part): an auto mark
survives a restart and reads as the system's; an operator's cordon over it makes it theirs; the
system never lifts an operator's mark or a drain."""

from __future__ import annotations

from pathlib import Path

from llmgw.doctor.facts import NodeFacts
from llmgw.server.drain import Drainer, MarkStore
from llmgw.server.remedy import MarkKind, mark_kind
from llmgw.server.remedy_service import _label, grade
from llmgw.wire import messages as m
from tests.unit.test_drainer import Clock, Registry, models
from tests.unit.test_reconcile import make


def drainer(tmp_path: Path) -> Drainer:
    return Drainer(MarkStore(tmp_path), make(models()), Registry("gpu-01", "gpu-02"), now=Clock(), wake=lambda: None)


def test_auto_marks_are_kept_shown_and_only_the_systems_are_lifted(tmp_path: Path) -> None:
    d = drainer(tmp_path)
    assert d.auto_cordon("gpu-01", "gpu 3 Xid 79")
    assert not d.auto_cordon("gpu-01", "gpu 4 Xid 79")  # already marked
    assert not d.auto_cordon("gpu-09", "gpu 0 Xid 79")  # not registered
    assert d.mark_of("gpu-01") == "cordoned (auto: gpu 3 Xid 79)" and d.cordoned() == {"gpu-01"}
    again = drainer(tmp_path)  # a restarted server
    assert mark_kind(again.marks["gpu-01"].who) == MarkKind.AUTO
    assert again.auto_uncordon("gpu-01") and again.mark_of("gpu-01") == ""

    assert d.cordon("gpu-02", "operator token") == ""
    assert not d.auto_uncordon("gpu-02")  # an operator's: never lifted automatically
    d2 = drainer(tmp_path / "b")
    d2.auto_cordon("gpu-01", "gpu 3 Xid 79")
    assert d2.cordon("gpu-01", "operator token") == ""  # the operator takes it over
    assert mark_kind(d2.marks["gpu-01"].who) == MarkKind.OPERATOR and d2.mark_of("gpu-01") == "cordoned"
    assert not d2.auto_uncordon("gpu-01")
    d2.drain("gpu-02", "operator token", force=False)
    assert not d2.auto_uncordon("gpu-02")


def test_grade_reads_the_gpu_checks() -> None:
    inv = m.Inventory(gpus=[m.Gpu(index=i, name="H200", memory_mib=141000) for i in range(4)], gpu_source="sim")
    facts = [NodeFacts(id="n1", state="ready", inventory=inv,
                       gpus=[m.GpuHealth(index=0), m.GpuHealth(index=1, xid=79), m.GpuHealth(index=2),
                             m.GpuHealth(index=3, ecc_uncorrected=4)]),
             NodeFacts(id="n2", state="ready", inventory=inv, gpus=[m.GpuHealth(index=i) for i in range(4)])]
    got = grade(facts, ())
    assert got["n2"] == []
    assert [(f.gpu, f.reason) for f in got["n1"]] == [(1, "gpu 1 Xid 79"), (3, "gpu 3 4 uncorrected ECC errors")]
    assert [_label(f.reason) for f in got["n1"]] == ["xid-79", "ecc"]
