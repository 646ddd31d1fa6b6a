"""Placement on the simulated real boxes: NVLink-aware within a node (NVSwitch board, bridged
PCIe box, topology unknown) and across nodes (N nodes on one usable fabric, with the reasons
when no set of N fits: a port in INIT, no two nodes sharing a fabric)."""

from __future__ import annotations

from llmgw.placement import NodeCapacity, NoFit, Request, place
from llmgw.placement.multi import MultiPlacement, place_multi
from llmgw.sim.node import NodeSpec, plan_node
from llmgw.sim.profiles import BASE, PROFILES
from llmgw.wire.messages import Gpu

PORTS = (20000, 20099)


def gpus_of(profile: str) -> list[Gpu]:
    plan = plan_node(NodeSpec(node_id="n-1", **{**BASE, **PROFILES[profile]}))  # type: ignore[arg-type]
    return [Gpu(index=g.index, name=g.name, memory_mib=g.memory_mib, nvlink=dict(g.nvlink)) for g in plan.gpu_file.gpus]


def node(node_id: str, gpus: list[Gpu], fabrics: list[str] | None = None, notes: dict[str, str] | None = None,
         used: set[int] | None = None, address: str = "10.0.0.1") -> NodeCapacity:
    return NodeCapacity(node_id=node_id, state="ready", gpus=gpus, used_gpus=used or set(), fabrics=fabrics or [],
                        fabric_notes=notes or {}, address=address)


def test_nvswitch_board_any_four_are_equal_so_the_lowest():
    got = place(Request(replica_id="r.1", gpus=4), [node("a", gpus_of("dgx-h100"), used={0})], PORTS)
    assert not isinstance(got, NoFit) and got.gpus == (1, 2, 3, 4)


def test_bridged_pcie_box_tp2_takes_a_bridged_pair():
    got = place(Request(replica_id="r.1", gpus=2), [node("a", gpus_of("pcie-4gpu-bridged"), used={1})], PORTS)
    assert not isinstance(got, NoFit) and got.gpus == (2, 3)  # not 0 and 2, which no bridge joins


def test_unknown_topology_takes_the_lowest_free():
    unknown = [Gpu(index=i, name="NVIDIA H100 80GB HBM3", memory_mib=81559) for i in range(8)]
    got = place(Request(replica_id="r.1", gpus=2), [node("a", unknown, used={0})], PORTS)
    assert not isinstance(got, NoFit) and got.gpus == (1, 2)


def test_two_nodes_on_the_shared_fabric():
    nodes = [node("gpu-01", gpus_of("dgx-h100"), ["ib"], address="10.0.0.1"),
             node("gpu-02", gpus_of("dgx-h100"), ["ib", "roce"], address="10.0.0.2"),
             node("gpu-03", gpus_of("roce-8nic"), ["roce"], address="10.0.0.3")]
    got = place_multi(Request(replica_id="big-x.1", gpus=8), 2, nodes, PORTS)
    assert isinstance(got, MultiPlacement)
    assert got.fabric == "ib"
    assert [r.node_id for r in got.ranks] == ["gpu-01", "gpu-02"]
    assert all(r.gpus == tuple(range(8)) for r in got.ranks)
    assert got.master_addr == "10.0.0.1"
    assert got.master_port != got.ranks[0].port and PORTS[0] <= got.master_port <= PORTS[1]


def test_a_port_in_init_takes_the_node_out_with_the_reason():
    nodes = [node("gpu-01", gpus_of("dgx-h100"), ["ib"]),
             node("gpu-02", gpus_of("dgx-h100"), [],
                  {"ib": "mlx5_1: no ACTIVE port (port 1 INIT (LinkUp): no subnet manager has brought it up)"})]
    got = place_multi(Request(replica_id="big-x.1", gpus=8), 2, nodes, PORTS)
    assert isinstance(got, NoFit)
    text = got.summary()
    assert "needs 2 nodes sharing a usable fabric, 8 GPUs on each" in text
    assert "fabric ib: 1 of 2 nodes (gpu-01)" in text
    assert "gpu-02: fabric ib not usable (mlx5_1: no ACTIVE port (port 1 INIT (LinkUp): no subnet manager" in text


def test_no_two_nodes_share_a_fabric():
    nodes = [node("gpu-01", gpus_of("dgx-h100"), ["ib-a"]), node("gpu-02", gpus_of("dgx-h100"), ["ib-b"])]
    got = place_multi(Request(replica_id="big-x.1", gpus=4), 2, nodes, PORTS)
    assert isinstance(got, NoFit)
    assert "fabric ib-a: 1 of 2 nodes (gpu-01)" in got.reasons and "fabric ib-b: 1 of 2 nodes (gpu-02)" in got.reasons


def test_gpus_per_node_and_busy_nodes():
    nodes = [node("gpu-01", gpus_of("dgx-h100"), ["ib"], used=set(range(6))),
             node("gpu-02", gpus_of("dgx-h100"), ["ib"]), node("gpu-03", gpus_of("dgx-h100"), ["ib"])]
    got = place_multi(Request(replica_id="big-x.1", gpus=4), 2, nodes, PORTS)
    assert isinstance(got, MultiPlacement) and [r.node_id for r in got.ranks] == ["gpu-02", "gpu-03"]
    refused = place_multi(Request(replica_id="big-x.1", gpus=4), 3, nodes, PORTS)
    assert isinstance(refused, NoFit)
    assert "gpu-01: 2 of 8 GPUs free, 4 needed" in refused.reasons
    assert "fabric ib: 2 of 3 nodes (gpu-02, gpu-03)" in refused.reasons


def test_a_node_whose_address_is_unknown_cannot_be_a_rank():
    # Every rank dials rank 0's address: no Start goes out before it is known.
    nodes = [node("gpu-01", gpus_of("dgx-h100"), ["ib"], address=""), node("gpu-02", gpus_of("dgx-h100"), ["ib"])]
    got = place_multi(Request(replica_id="big-x.1", gpus=8), 2, nodes, PORTS)
    assert isinstance(got, NoFit)
    assert "gpu-01: its address is not known yet (the master address of a multi-node replica)" in got.reasons
