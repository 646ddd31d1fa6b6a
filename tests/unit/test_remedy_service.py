"""The remedy service over a real registry and drain marks: it grades only nodes whose heartbeat
changed (in a worker thread), cordons after `hold` readings, and takes GPUs out of placement
through the controller's view of the nodes."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from llmgw.catalog.schema import RemedySettings
from llmgw.catalog.units import dec_hook
from llmgw.server import remedy_service
from llmgw.server.drain import Drainer, MarkStore
from llmgw.server.reconcile import Reconciler, Settings
from llmgw.server.registry import NodeRegistry
from llmgw.server.remedy_service import RemedyService
from llmgw.wire import messages as m


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def fleet(tmp_path: Path, mode: str = "act") -> tuple[NodeRegistry, RemedyService, Drainer, Clock, list[str]]:
    registry = NodeRegistry(heartbeat_interval=1.0)
    gpus = [m.Gpu(index=i, name="H200", memory_mib=141000) for i in range(2)]
    for node in ("gpu-01", "gpu-02"):
        registry.register(m.Register(node_id=node, version="x", inventory=m.Inventory(gpus=gpus, gpu_source="sim")),
                          now=0.0, session=1)
    rec = Reconciler([], Settings(backoff_initial=1, backoff_max=10, port_range=(20000, 20999)))
    clock = Clock()
    drainer = Drainer(MarkStore(tmp_path), rec, registry, now=clock, wake=lambda: None)
    said: list[str] = []
    settings = msgspec.convert({"auto_remediate": mode, "hold": 2, "clear_after": 10}, RemedySettings,
                               dec_hook=dec_hook)
    service = RemedyService(settings, registry, rec, drainer, record=lambda kind, message, node: said.append(message),
                            clock=clock)
    return registry, service, drainer, clock, said


def beat(registry: NodeRegistry, node: str, now: float, xid: int = 0) -> None:
    registry.heartbeat(node, 1, m.Heartbeat(gpus=[m.GpuHealth(index=0), m.GpuHealth(index=1, xid=xid)]), now)


async def test_only_changed_heartbeats_are_graded_and_a_held_finding_cordons(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    registry, service, drainer, clock, said = fleet(tmp_path)
    graded: list[list[str]] = []
    real = remedy_service.grade
    monkeypatch.setattr(remedy_service, "grade", lambda facts, checks: graded.append([f.id for f in facts]) or
                        real(facts, checks))
    beat(registry, "gpu-01", 1.0, xid=79)
    beat(registry, "gpu-02", 1.0)
    await service.step()
    assert graded == [["gpu-01", "gpu-02"]]
    assert service.unplaceable() == {"gpu-01": {1: "gpu 1 Xid 79"}}
    assert drainer.marks == {}  # one reading: not yet
    await service.step()  # no new heartbeat: nothing graded, nothing counted twice
    assert graded == [["gpu-01", "gpu-02"]] and drainer.marks == {}
    clock.t = 2.0
    beat(registry, "gpu-01", 2.0, xid=79)
    await service.step()
    assert graded[-1] == ["gpu-01"]
    assert drainer.mark_of("gpu-01") == "cordoned (auto: gpu 1 Xid 79)"
    assert any("cordoned automatically: gpu 1 Xid 79" in s for s in said), said
    assert service.cordons.labels("xid-79")._value.get() == 1.0


async def test_report_mode_cordons_nothing_and_a_reload_to_off_frees_the_gpu(tmp_path: Path) -> None:
    registry, service, drainer, clock, said = fleet(tmp_path, mode="report")
    for t in (1.0, 2.0, 3.0):
        clock.t = t
        beat(registry, "gpu-01", t, xid=79)
        await service.step()
    assert drainer.marks == {} and service.unplaceable() == {"gpu-01": {1: "gpu 1 Xid 79"}}
    assert sum("not cordoned: auto_remediate: report" in s for s in said) == 1, said
    service.configure(msgspec.structs.replace(service.settings, auto_remediate="off"))
    assert service.unplaceable() == {}
