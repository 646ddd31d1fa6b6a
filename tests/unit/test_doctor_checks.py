"""Doctor's pure checks on data: each one's ok, warn, crit (and unknown for what an older agent
does not send), the runner's deadline and guard, and the exit code a report maps to."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw import doctor
from llmgw.doctor.facts import (
    CLUSTER,
    ClusterFacts,
    FabricFacts,
    FabricProblemFact,
    Finding,
    ModelFacts,
    NodeFacts,
    ReplicaFacts,
    report,
)
from llmgw.doctor.node import NODE_CHECKS, NodeContext, fabric_rates
from llmgw.verdict import Status
from llmgw.wire import messages as m

OK, WARN, CRIT, UNKNOWN = Status.OK, Status.WARN, Status.CRIT, Status.UNKNOWN
GIB = 1024**3


def healthy(node_id: str = "gpu-01", **changes: object) -> NodeFacts:
    ports = [m.Port(device=f"mlx5_{d}", port=1, state="ACTIVE", phys_state="LinkUp", rate_gbps=400.0, sm_lid=1)
             for d in range(2)]
    readings = [m.PortCounters(device=p.device, port=1, state="ACTIVE", phys_state="LinkUp", rate_gbps=400.0,
                               counters={"symbol_error": 0, "link_downed": 0, "port_rcv_errors": 0}) for p in ports]
    gpus = [m.Gpu(index=i, name="H100", nvlink={j: 18 for j in range(2) if j != i}) for i in range(2)]
    facts = NodeFacts(
        id=node_id, state="ready", connected=True, last_heartbeat_age=1.0, heartbeat_interval=5.0,
        inventory=m.Inventory(gpus=gpus, ports=ports, gpu_source="nvml", gpu_driver="550.54.15"),
        fabric_status=[m.FabricStatus(name="ib", devices=["mlx5_0", "mlx5_1"], usable=True,
                                      ports=["mlx5_0:1", "mlx5_1:1"])],
        gpus=[m.GpuHealth(index=i, ecc_uncorrected=0, nvlink_down=0, xid=0, board_read=True) for i in range(2)],
        ports=readings, ports_before=readings, window=60.0,
        host=m.HostFacts(memlock_bytes=m.MEMLOCK_UNLIMITED, model_cache="/var/cache/llmgw",
                         cache_free_bytes=500 * GIB, cache_total_bytes=1000 * GIB, gpu_rdma_modules=["nvidia_peermem"]),
        cert_days_left=90.0, clock_skew=0.01,
    )
    return msgspec.structs.replace(facts, **changes)


def grade(check: str, n: NodeFacts, ctx: NodeContext | None = None) -> list[Finding]:
    return NODE_CHECKS[check](n, ctx or NodeContext(fabric_rates=fabric_rates([n])))


def statuses(findings: list[Finding]) -> list[Status]:
    return [f.status for f in findings]


def test_a_healthy_node_is_ok_on_every_check() -> None:
    for name in NODE_CHECKS:
        found = grade(name, healthy())
        assert statuses(found) == [OK], (name, found)
        assert all(not f.action for f in found)


def test_every_problem_says_what_to_do() -> None:
    bad = healthy(state="lost", connected=False)
    assert all(f.action for f in grade("agent", bad))


def test_agent() -> None:
    assert statuses(grade("agent", healthy(last_heartbeat_age=11.0))) == [WARN]
    assert statuses(grade("agent", healthy(state="unreachable", reason="no heartbeat for 16s"))) == [CRIT]
    assert "no heartbeat for 16s" in grade("agent",
                                           healthy(state="unreachable", reason="no heartbeat for 16s"))[0].finding
    assert statuses(grade("agent", healthy(connected=False, state="lost"))) == [CRIT]


def test_nvml() -> None:
    def inv(**kw: object) -> NodeFacts:
        return healthy(inventory=msgspec.structs.replace(healthy().inventory, **kw))

    assert "driver 550.54.15" in grade("nvml", healthy())[0].finding
    assert statuses(grade("nvml", inv(gpu_driver=""))) == [UNKNOWN]  # an older agent
    found = grade("nvml", inv(gpus=[], gpu_source="none", gpu_note="libnvidia-ml.so.1 not found"))
    assert statuses(found) == [UNKNOWN] and "libnvidia-ml.so.1 not found" in found[0].finding and found[0].action
    assert statuses(grade("nvml",
                          inv(gpus=[], gpu_source="none", gpu_note="CPU-only node (discovery.gpus: none)"))) == [OK]
    assert statuses(grade("nvml", inv(gpu_source="sim", gpu_driver=""))) == [OK]


def test_gpu_health() -> None:
    def gpus(**kw: object) -> NodeFacts:
        return healthy(gpus=[m.GpuHealth(index=0, ecc_uncorrected=0, nvlink_down=0, xid=0),
                             m.GpuHealth(index=1, **kw)])  # type: ignore[arg-type]

    assert statuses(grade("gpu-health", gpus(ecc_uncorrected=3))) == [CRIT]
    assert statuses(grade("gpu-health", gpus(health="lost"))) == [CRIT]
    assert statuses(grade("gpu-health", gpus(xid=79))) == [CRIT]
    assert statuses(grade("gpu-health", gpus(xid=13))) == [WARN]
    assert statuses(grade("gpu-health", healthy(gpus=[m.GpuHealth(index=0)]))) == [CRIT]  # GPU 1 fell off
    found = grade("gpu-health", gpus())  # GPU 1 without ECC readings (an older agent)
    assert statuses(found) == [OK] and "ECC not reported for GPU 1" in found[0].finding
    found = grade("gpu-health",
                  healthy(gpus=[m.GpuHealth(index=0, ecc_uncorrected=0), m.GpuHealth(index=1, ecc_uncorrected=0)]))
    assert statuses(found) == [OK] and "Xids not reported" in found[0].finding  # where NVML delivers none
    assert statuses(grade("gpu-health", healthy(gpus=None))) == [UNKNOWN]  # no heartbeat yet


def test_nvlink() -> None:
    down = healthy(gpus=[m.GpuHealth(index=0, nvlink_down=0), m.GpuHealth(index=1, nvlink_down=2)])
    found = grade("nvlink", down)
    assert statuses(found) == [CRIT] and found[0].subject == "GPU 1"
    fewer = healthy(inventory=msgspec.structs.replace(
        healthy().inventory, gpus=[m.Gpu(index=0, nvlink={1: 18}), m.Gpu(index=1, nvlink={0: 16})]))
    assert statuses(grade("nvlink", fewer)) == [WARN]
    assert statuses(grade("nvlink", healthy(gpus=[m.GpuHealth(index=0), m.GpuHealth(index=1)]))) == [UNKNOWN]
    pcie = healthy(inventory=msgspec.structs.replace(healthy().inventory, gpus=[m.Gpu(index=0)]))
    assert statuses(grade("nvlink", pcie)) == [OK]


def test_adapters() -> None:
    missing = healthy(fabric_status=[m.FabricStatus(name="ib", devices=["mlx5_0", "mlx5_1", "mlx5_7"])])
    found = grade("adapters", missing)
    assert statuses(found) == [CRIT] and found[0].subject == "mlx5_7" and "fabric ib" in found[0].finding


def _port_state(n: NodeFacts, device: str, state: str, phys: str) -> NodeFacts:
    ports = [msgspec.structs.replace(p, state=state, phys_state=phys) if p.device == device else p for p in n.ports]
    return msgspec.structs.replace(n, ports=ports)


def test_ports() -> None:
    n = healthy()
    found = grade("ports", _port_state(n, "mlx5_1", "INIT", "LinkUp"))
    assert statuses(found) == [CRIT] and found[0].subject == "mlx5_1/1" and "no subnet manager" in found[0].finding
    assert statuses(grade("ports", _port_state(n, "mlx5_1", "ARMED", "LinkUp"))) == [WARN]
    assert statuses(grade("ports", _port_state(n, "mlx5_0", "DOWN", "Polling"))) == [CRIT]
    undeclared = msgspec.structs.replace(_port_state(n, "mlx5_0", "DOWN", "Disabled"),
                                         fabric_status=[m.FabricStatus(name="ib", devices=["mlx5_1"])])
    assert statuses(grade("ports", undeclared)) == [WARN]  # on no fabric: worth a look, not an outage


def test_port_rate_against_the_fleet() -> None:
    slow = healthy("gpu-02")
    slow = msgspec.structs.replace(slow, ports=[msgspec.structs.replace(p, rate_gbps=100.0) if p.device == "mlx5_1"
                                                else p for p in slow.ports])
    ctx = NodeContext(fabric_rates=fabric_rates([healthy(), slow]))
    assert ctx.fabric_rates == {"ib": 400.0}
    found = grade("port-rate", slow, ctx)
    assert statuses(found) == [CRIT] and found[0].subject == "mlx5_1/1"  # 25 % of the fabric's rate
    mid = msgspec.structs.replace(slow, ports=[msgspec.structs.replace(p, rate_gbps=300.0) for p in slow.ports])
    assert statuses(grade("port-rate", mid, ctx)) == [WARN, WARN]  # 75 %
    assert statuses(grade("port-rate", healthy(), ctx)) == [OK]


def test_counters_rising() -> None:
    n = healthy()

    def later(**counters: int) -> NodeFacts:
        ports = [msgspec.structs.replace(p, counters={**p.counters, **counters}) if p.device == "mlx5_0" else p
                 for p in n.ports]
        return msgspec.structs.replace(n, ports=ports)

    found = grade("counters", later(symbol_error=12))
    assert statuses(found) == [WARN] and "symbol_error +12 in 60s" in found[0].finding
    assert statuses(grade("counters", later(link_downed=1))) == [CRIT]
    static = msgspec.structs.replace(later(symbol_error=1873), ports_before=later(symbol_error=1873).ports)
    found = grade("counters", static)
    assert statuses(found) == [OK] and "not rising" in found[0].finding
    assert statuses(grade("counters", healthy(ports_before=None))) == [UNKNOWN]


def test_memlock() -> None:
    limited = m.HostFacts(memlock_bytes=8 * 1024 * 1024)
    found = grade("memlock", healthy(host=limited))
    assert statuses(found) == [CRIT] and "8.0 MiB" in found[0].finding and "LimitMEMLOCK=infinity" in found[0].action
    simulated = m.HostFacts(memlock_bytes=8 * 1024 * 1024, rdma_simulated=True)
    assert statuses(grade("memlock", healthy(host=simulated))) == [OK]
    no_rdma = healthy(host=limited, inventory=msgspec.structs.replace(healthy().inventory, ports=[]))
    assert statuses(grade("memlock", no_rdma)) == [OK]
    assert statuses(grade("memlock", healthy(host=None))) == [UNKNOWN]


def test_disk() -> None:
    def free(n: int, total: int = 1000 * GIB) -> NodeFacts:
        return healthy(host=m.HostFacts(memlock_bytes=-1, model_cache="/c", cache_free_bytes=n,
                                        cache_total_bytes=total))

    assert statuses(grade("disk", free(80 * GIB))) == [WARN]  # 8 %
    assert statuses(grade("disk", free(20 * GIB))) == [CRIT]  # 2 %
    assert statuses(grade("disk", free(5 * GIB, 40 * GIB))) == [WARN]  # under 10 GiB
    assert statuses(grade("disk", free(1 * GIB, 4 * GIB))) == [CRIT]  # under 2 GiB
    assert statuses(grade("disk", healthy(host=m.HostFacts(model_cache="/c")))) == [UNKNOWN]


def test_cert_and_clock() -> None:
    assert statuses(grade("cert", healthy(cert_days_left=10.0))) == [WARN]
    assert statuses(grade("cert", healthy(cert_days_left=1.0))) == [CRIT]
    assert statuses(grade("cert", healthy(cert_days_left=-2.0))) == [CRIT]
    assert statuses(grade("cert", healthy(cert_days_left=None))) == [OK]  # no client certificate in use
    assert statuses(grade("clock", healthy(clock_skew=-3.0))) == [WARN]
    assert "ahead of" in grade("clock", healthy(clock_skew=-3.0))[0].finding
    assert statuses(grade("clock", healthy(clock_skew=120.0))) == [CRIT]
    assert statuses(grade("clock", healthy(clock_skew=None))) == [UNKNOWN]


def cluster(**kw: object) -> ClusterFacts:
    base = ClusterFacts(nodes=[healthy()], models=[ModelFacts(name="small", replicas=2)],
                        replicas=[ReplicaFacts(id=f"small-{i}", model="small", state="ready") for i in range(2)])
    return msgspec.structs.replace(base, **kw)


def run(facts: ClusterFacts, **kw: object) -> list[Finding]:
    return doctor.run(facts, clock=lambda: 0.0, deadline=1.0, **kw)  # type: ignore[arg-type]


def test_cluster_checks() -> None:
    assert report(run(cluster()), 1).exit_code == 0
    lost = cluster(nodes=[healthy(), healthy("gpu-02", state="lost", connected=False)])
    nodes = [f for f in run(lost) if f.check == "nodes"]
    assert statuses(nodes) == [WARN] and "gpu-02 lost" in nodes[0].finding
    problems = [FabricProblemFact(kind="no_standby", message="no standby subnet manager"),
                FabricProblemFact(kind="degraded_link", message="gpu-02 [1] ↔ leaf-1 [3]: 1X of 4X")]
    fabrics = [f for f in run(cluster(fabrics=[FabricFacts(id="0xabc", problems=problems)])) if f.check == "fabrics"]
    assert statuses(fabrics) == [WARN, WARN] and all(f.action for f in fabrics)
    sm = [f for f in run(cluster(fabrics=[FabricFacts(id="0xabc",
                                                      problems=[FabricProblemFact(kind="no_sm", message="x")])]))
          if f.check == "fabrics"]
    assert statuses(sm) == [CRIT]


def test_replicas() -> None:
    pending = ReplicaFacts(id="small-2", model="small", state="pending", reason="gpu-01: 0 of 8 GPUs free, 1 needed")
    found = [f for f in run(cluster(replicas=[*cluster().replicas, pending])) if f.check == "replicas"]
    assert statuses(found) == [WARN] and "gpu-01: 0 of 8 GPUs free" in found[0].finding
    failed = [ReplicaFacts(id=f"small-{i}", model="small", state="failed", failures=3, reason="exit 1")
              for i in range(2)]
    assert statuses([f for f in run(cluster(replicas=failed)) if f.check == "replicas"]) == [CRIT, CRIT]
    stuck = [ReplicaFacts(id="small-0", model="small", state="ready"),
             ReplicaFacts(id="small-1", model="small", state="starting", state_age=1200.0)]
    assert statuses([f for f in run(cluster(replicas=stuck)) if f.check == "replicas"]) == [WARN]
    young = [ReplicaFacts(id="small-0", model="small", state="starting", state_age=30.0)]
    assert statuses([f for f in run(cluster(replicas=young)) if f.check == "replicas"]) == [OK]


def test_narrowing_and_local() -> None:
    facts = cluster(nodes=[healthy(), healthy("gpu-02")])
    assert {f.node for f in run(facts, node="gpu-02")} == {"gpu-02"}
    assert [f.check for f in run(facts, check="memlock")] == ["memlock", "memlock"]
    assert [f.node for f in run(facts, check="replicas")] == [CLUSTER]
    local = {f.check for f in run(cluster(), local=True, cluster=False)}
    assert "agent" not in local and "clock" not in local and "memlock" in local


def test_a_node_that_is_gone_gets_one_unknown_for_its_stale_readings() -> None:
    found = [f for f in run(cluster(nodes=[healthy(state="unreachable", connected=False)])) if f.node == "gpu-01"]
    assert statuses(found) == [CRIT, UNKNOWN] and "stale" in found[1].finding


def test_the_deadline_makes_the_rest_unknown_never_a_hang() -> None:
    ticks = itertools.count()
    facts = cluster(nodes=[healthy(f"gpu-{i:02d}") for i in range(5)])
    found = doctor.run(facts, clock=lambda: float(next(ticks)), deadline=2.5)
    late = [f for f in found if f.status == UNKNOWN]
    assert {f.node for f in late} >= {"gpu-03", "gpu-04", CLUSTER}
    assert all("deadline" in f.finding for f in late)


def test_a_check_that_raises_is_unknown_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(n: NodeFacts, ctx: NodeContext) -> list[Finding]:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setitem(NODE_CHECKS, "disk", broken)
    [found] = [f for f in run(cluster()) if f.check == "disk"]
    assert found.status == UNKNOWN and "ZeroDivisionError" in found.finding


@pytest.mark.parametrize(("found", "code"), [
    ([], 0), ([OK, OK], 0), ([OK, WARN], 1), ([WARN, CRIT], 2), ([OK, UNKNOWN], 3), ([UNKNOWN, WARN], 1),
])
def test_report_exit_codes(found: list[Status], code: int) -> None:
    r = report([Finding(node="n", check="c", status=s, finding="x") for s in found], nodes=1)
    assert r.exit_code == code
    assert r.summary.ok + r.summary.warn + r.summary.crit + r.summary.unknown == len(found)


@settings(max_examples=60, deadline=None)
@given(st.builds(NodeFacts, id=st.just("n"), state=st.sampled_from(["ready", "lost", "local"]),
                 connected=st.booleans(), last_heartbeat_age=st.none() | st.floats(0, 1e6),
                 clock_skew=st.none() | st.floats(-1e6, 1e6), cert_days_left=st.none() | st.floats(-1e3, 1e3),
                 host=st.none() | st.builds(m.HostFacts, memlock_bytes=st.none() | st.integers(-1, 2**40),
                                            cache_free_bytes=st.none() | st.integers(0, 2**50),
                                            cache_total_bytes=st.none() | st.integers(0, 2**50))))
def test_arbitrary_facts_never_raise(n: NodeFacts) -> None:
    found = run(ClusterFacts(nodes=[n]))
    assert found and all(f.status != UNKNOWN or "check failed" not in f.finding for f in found)


def test_a_roce_port_in_init_is_not_told_to_start_opensm() -> None:
    # issue 38, item 9: Ethernet has no subnet manager; a RoCE port that is not ACTIVE is a link,
    # LLDP or PFC matter (rdma-core: a RoCE port's state follows its netdev's carrier).
    n = _port_state(healthy(), "mlx5_1", "INIT", "LinkUp")
    inventory = msgspec.structs.replace(n.inventory, ports=[
        msgspec.structs.replace(p, link_layer="Ethernet") if p.device == "mlx5_1" else p for p in n.inventory.ports])
    roce = msgspec.structs.replace(n, inventory=inventory)
    found = grade("ports", roce)
    assert statuses(found) == [CRIT] and found[0].subject == "mlx5_1/1"
    assert "subnet manager" not in found[0].finding
    assert "opensm" not in found[0].action and "subnet manager" not in found[0].action
    assert "ip link" in found[0].action and "PFC" in found[0].action
