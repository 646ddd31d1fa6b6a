"""The simulated node's plan: values in the real formats, identities stable and distinct."""

from __future__ import annotations

import pytest

from llmgw.errors import UsageError
from llmgw.fabric import sysfs
from llmgw.sim import node as simnode


def test_guids_are_deterministic_and_distinct_across_a_fleet():
    ids = [f"node-{i}" for i in range(2000)] + [f"gpu{i:03d}.rack{i % 7}" for i in range(2000)]
    guids = [simnode.node_guid(n, d) for n in ids for d in range(8)]
    assert len(set(guids)) == len(guids)
    assert simnode.node_guid("node-1", 0) == simnode.node_guid("node-1", 0)
    assert all(g >> 40 == simnode.NVIDIA_OUI for g in guids[:100])


def test_lids_of_numbered_nodes_are_distinct_and_unicast():
    lids = [
        simnode.port_lid(f"node-{i}", d)
        for i in range(1, 1001)
        for d in range(simnode.MAX_RDMA_DEVICES)
    ]
    assert len(set(lids)) == len(lids)
    assert min(lids) >= simnode.MAX_RDMA_DEVICES  # block 0 is left to switches and the SM
    assert max(lids) <= 0xBFFF
    assert simnode.port_lid("node-1", 0) != simnode.SM_LID


def test_sysfs_guid_format_parses_back():
    guid = simnode.node_guid("node-9", 3)
    assert sysfs.parse_guid(simnode.sysfs_guid(guid)) == f"0x{guid:016x}"
    assert len(simnode.sysfs_guid(guid).split(":")) == 4


def test_plan_writes_kernel_formats():
    plan = simnode.plan_node(
        simnode.NodeSpec(node_id="node-2", ib_ports=2, roce_ports=1, degraded=1)
    )
    port = "sys/class/infiniband/mlx5_0/ports/1/"
    assert plan.files[port + "state"] == "4: ACTIVE\n"
    assert plan.files[port + "phys_state"] == "5: LinkUp\n"
    assert plan.files[port + "rate"] == "400 Gb/sec (4X NDR)\n"
    assert plan.files[port + "link_layer"] == "InfiniBand\n"
    assert plan.files[port + "lid"] == f"0x{simnode.port_lid('node-2', 0):x}\n"
    assert plan.files[port + "sm_lid"] == "0x1\n"
    assert plan.files["sys/class/infiniband/mlx5_1/ports/1/rate"] == "100 Gb/sec (1X NDR)\n"
    assert plan.files["sys/class/infiniband/mlx5_1/ports/1/counters/symbol_error"] != "0\n"
    roce = "sys/class/infiniband/mlx5_2/ports/1/"
    assert plan.files[roce + "link_layer"] == "Ethernet\n"
    assert plan.files[roce + "lid"] == "0x0\n"
    assert plan.files[roce + "gid_attrs/ndevs/0"] == "eth0\n"
    assert plan.links["sys/class/net/eth0"].endswith("/net/eth0")
    parsed = sysfs.ports_from_tree(plan.files)
    assert [(p.device, p.link_layer, p.rate_gbps) for p in parsed] == [
        ("mlx5_0", "InfiniBand", 400.0),
        ("mlx5_1", "InfiniBand", 100.0),
        ("mlx5_2", "Ethernet", 200.0),
    ]


@pytest.mark.parametrize(
    ("rate", "degraded"),
    [
        ("400 Gb/sec (4X NDR)", "100 Gb/sec (1X NDR)"),
        ("200 Gb/sec (2X NDR)", "100 Gb/sec (1X NDR)"),
        ("25 Gb/sec (1X EDR)", "14 Gb/sec (1X FDR)"),
        ("2.5 Gb/sec (1X SDR)", "2.5 Gb/sec (1X SDR)"),
    ],
)
def test_degrade_rate(rate, degraded):
    assert simnode.degrade_rate(sysfs.parse_rate(rate)) == degraded


def test_nvlink_topologies():
    nv18 = simnode.plan_node(simnode.NodeSpec(node_id="a", gpus=4, nvlink="nv18")).gpu_file.gpus
    assert nv18[2].nvlink == {0: 18, 1: 18, 3: 18}
    none = simnode.plan_node(simnode.NodeSpec(node_id="a", gpus=4, nvlink="none")).gpu_file.gpus
    assert all(g.nvlink == {} for g in none)
    uuids = {g.uuid for g in nv18}
    assert len(uuids) == 4
    assert all(u.startswith("GPU-") for u in uuids)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"ib_rate": "fast"}, "--ib-rate"),
        ({"ib_rate": "400 Gb/sec (4X HDR)"}, "does not add up"),
        ({"roce_rate": "100 Gb/sec"}, "--roce-rate"),
        ({"nvlink": "nv99"}, "--nvlink"),
        ({"degraded": 5}, "--degraded"),
        ({"ib_ports": 30, "roce_ports": 3}, "at most 32"),
        ({"node_id": "a/b"}, "node id"),
        ({"gpus": -1}, "--gpus"),
    ],
)
def test_bad_specs_are_usage_errors(changes, message):
    spec = simnode.NodeSpec(
        node_id="node-1", **{k: v for k, v in changes.items() if k != "node_id"}
    )
    if "node_id" in changes:
        spec.node_id = changes["node_id"]
    with pytest.raises(UsageError, match=message):
        simnode.plan_node(spec)
