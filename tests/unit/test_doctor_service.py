"""The server's side of doctor: facts from the registry's heartbeats (two readings for a rise, the
clock skew), and a report that comes back within its deadline even when the checks do not."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

from llmgw.server import doctor as server_doctor
from llmgw.server.doctor import DoctorService
from llmgw.server.reconcile import Reconciler, Settings
from llmgw.server.registry import NodeRegistry
from llmgw.verdict import Status
from llmgw.wire import messages as m


def reconciler() -> Reconciler:
    return Reconciler([], Settings(backoff_initial=1, backoff_max=10, port_range=(20000, 20999)))


def registry_with_node(wall_offset: float = 0.0) -> NodeRegistry:
    registry = NodeRegistry(heartbeat_interval=5.0)
    inventory = m.Inventory(ports=[m.Port(device="mlx5_0", port=1, state="ACTIVE", rate_gbps=400.0)])
    registry.register(m.Register(node_id="gpu-01", version="x", inventory=inventory), now=0.0, session=1)
    return registry


def beat(registry: NodeRegistry, now: float, symbol_errors: int, sent_at: float, wall: float) -> None:
    port = m.PortCounters(device="mlx5_0", port=1, state="ACTIVE", rate_gbps=400.0,
                          counters={"symbol_error": symbol_errors})
    registry.heartbeat("gpu-01", 1, m.Heartbeat(sent_at=sent_at, ports=[port]), now, wall=wall)


def service(registry: NodeRegistry, **kw: object) -> DoctorService:
    return DoctorService(registry, reconciler(), clock=lambda: 100.0, wall=lambda: 1e9, **kw)  # type: ignore[arg-type]


def test_a_rise_needs_two_readings_and_the_skew_is_the_smallest_seen() -> None:
    registry = registry_with_node()
    beat(registry, 5.0, 0, sent_at=1e9 - 3.0, wall=1e9)  # a heartbeat 3 s late, or a clock 3 s behind
    [first] = service(registry).facts().nodes
    assert first.ports_before is None  # one reading: nothing to compare with
    beat(registry, 10.0, 40, sent_at=1e9 + 4.9, wall=1e9 + 5.0)
    [facts] = service(registry).facts().nodes
    assert facts.ports_before is not None and facts.window == 5.0
    assert facts.ports_before[0].counters["symbol_error"] == 0 and facts.ports[0].counters["symbol_error"] == 40
    assert facts.clock_skew == pytest.approx(0.1)


def test_an_agent_without_clock_or_host_facts_leaves_them_none() -> None:
    registry = registry_with_node()
    registry.heartbeat("gpu-01", 1, m.Heartbeat(), 5.0, wall=1e9)  # an older agent: no sent_at, no host
    [facts] = service(registry).facts().nodes
    assert facts.clock_skew is None and facts.host is None


async def test_the_report_grades_the_node() -> None:
    registry = registry_with_node()
    beat(registry, 5.0, 0, sent_at=1e9, wall=1e9)
    beat(registry, 10.0, 9, sent_at=1e9 + 5, wall=1e9 + 5)
    report = await service(registry).report(check="counters")
    [finding] = report.findings
    assert finding.status == Status.WARN and "symbol_error +9" in finding.finding and report.exit_code == 1


async def test_checks_that_never_come_back_are_unknown_at_the_deadline(
        monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock) -> None:
    """The worker hangs (a bug, a stuck lock): the answer comes at the deadline, with the reason,
    while trio's clock jumps (no wall-clock wait)."""
    release = threading.Event()

    def hang(*args: object, **kwargs: object) -> list[object]:
        release.wait(30)
        return []

    monkeypatch.setattr(server_doctor.doctor, "run", hang)
    try:
        start = trio.current_time()
        report = await DoctorService(registry_with_node(), reconciler(), wall=lambda: 1e9).report()
        assert trio.current_time() - start == pytest.approx(server_doctor.DEADLINE + server_doctor.GRACE)
    finally:
        release.set()
    assert report.exit_code == 3
    assert [f.status for f in report.findings] == [Status.UNKNOWN] and "did not finish" in report.findings[0].finding


async def test_a_thousand_nodes_are_graded_on_the_bounded_path() -> None:
    """The snapshot and the worker over 1,000 nodes: every node graded, every check run (none left
    unknown by the deadline). Its timing is bench/bench_doctor.py's (`make bench-doctor`)."""
    registry = NodeRegistry(heartbeat_interval=5.0)
    for i in range(1000):
        node_id = f"gpu-{i:04d}"
        ports = [m.Port(device=f"mlx5_{d}", port=1, state="ACTIVE", rate_gbps=400.0) for d in range(8)]
        registry.register(m.Register(node_id=node_id, version="x",
                                     inventory=m.Inventory(ports=ports, gpu_source="sim")),
                          now=0.0, session=i + 1)
        for now in (5.0, 10.0):
            readings = [m.PortCounters(device=p.device, port=1, state="ACTIVE", rate_gbps=400.0) for p in ports]
            host = m.HostFacts(memlock_bytes=m.MEMLOCK_UNLIMITED, cache_free_bytes=1 << 40, cache_total_bytes=1 << 41)
            registry.heartbeat(node_id, i + 1, m.Heartbeat(sent_at=1e9, ports=readings, host=host), now, wall=1e9)
    report = await DoctorService(registry, reconciler(), clock=lambda: 11.0, wall=lambda: 1e9).report()
    assert report.summary.nodes == 1000
    assert {f.node for f in report.findings} >= {f"gpu-{i:04d}" for i in range(1000)}
    assert report.exit_code == 0, [f for f in report.findings if f.status != Status.OK][:3]


async def test_the_version_checks_see_each_models_placement_pool_through_the_server() -> None:
    """The catalog's profiles travel into the facts (server/doctor.py), so driver-versions
    compares each model's pool: the one node on another driver is named with the model."""
    from llmgw.catalog.schema import Model, Profile

    registry = NodeRegistry(heartbeat_interval=5.0)
    for i, driver in enumerate(["550.54.15", "550.54.15", "550.90.07", "550.54.15"]):
        gpus = [m.Gpu(index=g, name="NVIDIA H100 80GB HBM3", memory_mib=81559) for g in range(8)]
        inventory = m.Inventory(gpus=gpus, gpu_source="nvml", gpu_driver=driver)
        registry.register(m.Register(node_id=f"gpu-0{i + 1}", version="x", inventory=inventory), now=0.0, session=i + 1)
    models = [Model(name="llama-70b", profiles=[Profile(gpus=8, gpu_kind="H100", gpu_memory_mib=80000)])]
    recon = Reconciler(models, Settings(backoff_initial=1, backoff_max=10, port_range=(20000, 20999)))
    doctor = DoctorService(registry, recon, clock=lambda: 100.0, wall=lambda: 1e9)
    assert doctor.facts().models[0].profiles[0].gpu_memory_mib == 80000
    report = await doctor.report(check="driver-versions")
    [odd] = [f for f in report.findings if f.status != Status.OK]
    assert odd.subject == "gpu-03" and "placement pool of llama-70b" in odd.finding, report.findings
