"""What /metrics says about the fleet's hardware: ports (state, rate, counters as Prometheus
counters), NVLink peers, and whether NVML was there at all. Inventories come from the agent's
real discovery (NVML through a fake module, or absent); the server side from its registry."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.agent import discovery
from llmgw.catalog.schema import Discovery
from llmgw.server.metrics import ServerMetrics
from llmgw.server.registry import NodeRegistry
from llmgw.wire import messages as m
from tests.unit.test_discovery import HGX_BUSES, SWITCH_BUSES, fake_nvml


@pytest.fixture
def fresh_nvml(monkeypatch):
    monkeypatch.setattr(discovery, "_nvml", discovery._Nvml())
    monkeypatch.setattr(discovery, "_logged", set())


def inventory_with(monkeypatch, nvml_result) -> m.Inventory:
    monkeypatch.setattr(discovery, "_nvml_init", lambda: nvml_result)
    return discovery.discover(Discovery(sysfs_root="/nonexistent", gpus="nvml"))


def families(metrics: ServerMetrics) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def samples(family) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples}


def test_nvml_present_and_absent(monkeypatch, fresh_nvml):
    links = {g: [("switch", SWITCH_BUSES[s]) for s, n in enumerate([5, 4, 4, 5]) for _ in range(n)] for g in range(8)}
    with_nvml = inventory_with(monkeypatch, (fake_nvml(HGX_BUSES, links), ""))
    monkeypatch.setattr(discovery, "_nvml", discovery._Nvml())
    without = inventory_with(monkeypatch,
                             (None, "libnvidia-ml.so.1 not found (no NVIDIA driver installed on this node)"))
    assert with_nvml.gpu_source == "nvml" and without.gpu_source == "none"
    assert "libnvidia-ml.so.1 not found" in without.gpu_note

    registry = NodeRegistry(1.0)
    registry.register(m.Register(node_id="gpu-1", version="t", inventory=with_nvml), 0.0, registry.new_session())
    registry.register(m.Register(node_id="gpu-2", version="t", inventory=without), 0.0, registry.new_session())
    got = families(ServerMetrics(registry.counts, nodes=lambda: registry.nodes.values()))
    nvml = samples(got["llmgw_node_nvml_available"])
    assert nvml == {(("node", "gpu-1"),): 1.0, (("node", "gpu-2"),): 0.0}
    peers = samples(got["llmgw_gpu_nvlink_peers"])
    assert peers[(("gpu", "3"), ("node", "gpu-1"))] == 7.0
    assert not [k for k in peers if ("node", "gpu-2") in k]  # no GPUs known: no zeros that look like PCIe


def test_ports_from_the_latest_heartbeat_counters_as_counters():
    registry = NodeRegistry(1.0)
    session = registry.new_session()
    inventory = m.Inventory(ports=[m.Port(device="mlx5_0", port=1, state="ACTIVE", rate_gbps=400.0),
                                   m.Port(device="i40iw0", port=1, state="ACTIVE", rate_gbps=10.0)])
    registry.register(m.Register(node_id="gpu-1", version="t", inventory=inventory), 0.0, session)
    metrics = ServerMetrics(registry.counts, nodes=lambda: registry.nodes.values())
    before = families(metrics)
    assert samples(before["llmgw_ib_port_active"])[
        (("device", "mlx5_0"), ("node", "gpu-1"), ("phys_state", ""), ("port", "1"), ("state", "ACTIVE"))] == 1.0

    beat = m.Heartbeat(seq=1, ports=[
        m.PortCounters(device="mlx5_0", port=1, state="DOWN", phys_state="Disabled", rate_gbps=400.0,
                       counters={"port_xmit_data": 123, "port_rcv_packets": 7, "symbol_error": 0},
                       hw_counters={"out_of_buffer": 5, "np_cnp_sent": None, "bad name": 1}),
        m.PortCounters(device="i40iw0", port=1, state="ACTIVE", rate_gbps=10.0,
                       counters={"port_xmit_data": None, "../made up\nname": 1}),
    ])
    registry.heartbeat("gpu-1", session, beat, 1.0)
    got = families(metrics)
    key = (("device", "mlx5_0"), ("node", "gpu-1"), ("port", "1"))
    # issue 38, item 11: an unplugged cable (DOWN/Polling) reads apart from a disabled port or no SM.
    assert samples(got["llmgw_ib_port_active"])[(*key[:2], ("phys_state", "Disabled"), key[2],
                                                 ("state", "DOWN"))] == 0.0
    assert samples(got["llmgw_ib_port_rate_gbps"])[key] == 400.0
    # Data words, packets and errors in separate families: a sum() never adds words to errors.
    by_family = {name: {(s.labels["device"], s.labels["counter"]): s.value for s in got[name].samples
                        if s.name.endswith("_total")}
                 for name in ("llmgw_ib_port_data_words", "llmgw_ib_port_packets", "llmgw_ib_port_errors")}
    assert all(got[name].type == "counter" for name in by_family)  # rate() works on them
    assert by_family["llmgw_ib_port_data_words"] == {("mlx5_0", "port_xmit_data"): 123.0}
    assert by_family["llmgw_ib_port_packets"] == {("mlx5_0", "port_rcv_packets"): 7.0}
    assert by_family["llmgw_ib_port_errors"] == {("mlx5_0", "symbol_error"): 0.0}
    # hw_counters (issue 39) in their own family: a name sysfs cannot have, or N/A, is not exported.
    hw = {(s.labels["device"], s.labels["counter"]): s.value for s in got["llmgw_rdma_port_hw_counters"].samples
          if s.name.endswith("_total")}
    assert got["llmgw_rdma_port_hw_counters"].type == "counter" and hw == {("mlx5_0", "out_of_buffer"): 5.0}
    values = {k: v for family in by_family.values() for k, v in family.items()}
    assert ("i40iw0", "port_xmit_data") not in values  # N/A (no PMA): no series, not a zero
    assert not [k for k in values if k[0] == "i40iw0"]  # a name no sysfs file has is not exported


def test_fabrics_message_replaces_the_nodes_fabrics():
    registry = NodeRegistry(1.0)
    session = registry.new_session()
    ib = m.FabricDecl(name="ib", devices=["mlx5_0"])
    registry.register(m.Register(node_id="gpu-1", version="t", fabrics=[ib],
                                 fabric_status=[m.FabricStatus(name="ib", devices=["mlx5_0"], usable=True,
                                                               ports=["mlx5_0:1"])]),
                      0.0, session)
    down = m.FabricStatus(name="ib", devices=["mlx5_0"], problems=["mlx5_0: no ACTIVE port (port 1 DOWN (Disabled))"])
    assert registry.fabrics_changed("gpu-1", session, m.Fabrics(fabrics=[], fabric_status=[down]), 1.0) == (["ib"], [])
    node = registry.get("gpu-1")
    assert node is not None and node.fabrics == [] and node.fabric_status == [down]
    assert registry.fabrics_changed("gpu-1", session + 1, m.Fabrics(fabrics=[ib]), 2.0) is None  # a replaced stream


def test_fabric_problems_are_labelled_by_fabric():
    # issue 38, item 11: two fabrics with a degraded cable each are two series, not one count of 2.
    from typing import Any, cast

    from llmgw.fabric.subnet import FabricProblem, FabricProblemKind, FabricReport
    from llmgw.server.fabric_service import FabricCollector

    class Service:
        report = FabricReport(fabrics=[], unmanaged=[], problems=[
            FabricProblem(kind=FabricProblemKind.SM_UNREADABLE, message="could not read the subnet manager list")])

        def fabric_ids(self) -> list[str]:
            return ["0xaa", "0xbb"]

        def problems(self, fabric_id: str) -> list[dict[str, Any]]:
            return [{"kind": "degraded_link", "message": "x"}]

    got = {f.name: f for f in FabricCollector(cast(Any, Service())).collect()}
    values = {tuple(sorted(s.labels.items())): s.value for s in got["llmgw_fabric_problems"].samples}
    assert values == {(("fabric", "0xaa"), ("kind", "degraded_link")): 1,
                      (("fabric", "0xbb"), ("kind", "degraded_link")): 1,
                      (("fabric", ""), ("kind", "sm_unreadable")): 1}
