"""Declared fabrics against the ports a node really has: a missing adapter, a port in INIT or
Polling, the wrong link layer each keep a fabric from being advertised, with the reason. On
ports parsed from real adapters' output, and on the simulated boxes (checked against real
`nvidia-smi topo -m` samples)."""

from __future__ import annotations

import msgspec
import pytest

from llmgw.fabric import declared, gputopo, hca
from llmgw.sim.node import NodeSpec, nvlink_peers, plan_node
from llmgw.sim.profiles import BASE, PROFILES
from llmgw.wire.messages import FabricDecl, FabricStatus, Port, PortCounters
from tests.realfixtures import REAL

NERSC = hca.parse_ibstat((REAL / "ibstat" / "nersc-8x-connectx5-edr-fdr-eth.txt").read_text())
CHRYSALIS = hca.parse_ibv_devinfo(
    (REAL / "ibv_devinfo" / "anl-chrysalis-hdr-cx6-ib-plus-2x-cx5-roce-verbose.txt").read_text())
NO_SM = hca.parse_ibstat((REAL / "ibstat" / "connectx3-qdr-initializing-no-sm.txt").read_text())


def test_all_declared_adapters_up_fabric_usable_at_its_slowest_link():
    [status] = declared.check_fabrics([FabricDecl(name="ib", devices=["mlx5_0", "mlx5_1", "mlx5_2"])], NERSC)
    assert status.usable and status.problems == []
    assert status.ports == ["mlx5_0:1", "mlx5_1:1", "mlx5_2:1"]
    assert status.rate_gbps == 56.0  # mlx5_1 runs at 56 (FDR); a collective runs at its slowest link


def test_declared_adapter_that_does_not_exist_keeps_the_fabric_out():
    [status] = declared.check_fabrics([FabricDecl(name="ib", devices=["mlx5_0", "mlx5_9"])], NERSC)
    assert not status.usable
    assert status.problems == ["mlx5_9: no such adapter on this node"]
    assert declared.advertised([status]) == []
    assert "mlx5_9: no such adapter" in declared.describe(status)


def test_port_in_init_means_no_subnet_manager():
    [status] = declared.check_fabrics([FabricDecl(name="ib", devices=["mlx4_0"])], NO_SM)
    assert not status.usable
    assert status.problems == ["mlx4_0: no ACTIVE port (port 1 INIT (LinkUp): no subnet manager has brought it up)"]


def test_polling_port_means_no_cable():
    port = Port(device="mlx5_0", port=1, state="DOWN", phys_state="Polling", rate_gbps=10.0)
    [status] = declared.check_fabrics([FabricDecl(name="ib", devices=["mlx5_0"])], [port])
    assert "DOWN (Polling): no cable" in status.problems[0]


def test_wrong_link_layer_is_not_part_of_the_fabric():
    [ib, roce] = declared.check_fabrics(
        [FabricDecl(name="ib", devices=["mlx5_0", "mlx5_1"]),
         FabricDecl(name="roce", kind="roce", devices=["mlx5_1", "mlx5_2"])],
        CHRYSALIS,
    )
    assert not ib.usable and ib.problems == ["mlx5_1: its ports are Ethernet, the fabric is infiniband (InfiniBand)"]
    assert roce.usable and roce.ports == ["mlx5_1:1", "mlx5_2:1"] and roce.rate_gbps == 100.0


def test_no_devices_declared_takes_the_active_ones_of_the_link_layer_on_one_subnet():
    # issue 38, item 5: the real NERSC node has IB ports on three subnets (SM lid 10: 4 EDR ports;
    # 43 and 344: FDR storage/other fabrics). NCCL_IB_HCA must never mix them.
    [status] = declared.check_fabrics([FabricDecl(name="ib")], NERSC)
    assert status.usable
    assert "mlx4_0:1" not in status.ports and "mlx5_3:1" not in status.ports  # Ethernet ports
    assert status.ports == ["mlx5_0:1", "mlx5_2:1", "mlx5_4:1", "mlx5_6:1"]
    assert status.rate_gbps == 100.0
    assert status.problems == ["left out, on another subnet than mlx5_0:1 (SM lid 10): mlx5_1:1 (SM lid 43), "
                               "mlx5_5:1 (SM lid 344), mlx5_7:1 (SM lid 43)"]


def test_subnets_are_told_apart_by_the_gid_prefix_too():
    ports = [Port(device=f"mlx5_{d}", port=1, state="ACTIVE", link_layer="InfiniBand", sm_lid=1, rate_gbps=400.0,
                  gid=("fe80:0000:0000:0000" if d < 2 else "fe80:0000:0000:0001") + f":0000:0000:0000:000{d}")
             for d in range(3)]
    [status] = declared.check_fabrics([FabricDecl(name="ib")], ports)
    assert status.ports == ["mlx5_0:1", "mlx5_1:1"]


def test_ethernet_fabric_has_nothing_rdma_to_check():
    [status] = declared.check_fabrics([FabricDecl(name="mgmt", kind="ethernet", devices=["eth0"])], [])
    assert status.usable and status.ports == []


def test_live_reading_replaces_state_and_drops_ports_that_vanished():
    live = [PortCounters(device="mlx5_0", port=1, state="DOWN", phys_state="Disabled", rate_gbps=0.0)]
    ports = declared.with_live(NERSC, live)
    assert [(p.device, p.state, p.phys_state, p.link_layer) for p in ports] == [("mlx5_0", "DOWN", "Disabled",
                                                                                 "InfiniBand")]
    [status] = declared.check_fabrics([FabricDecl(name="ib", devices=["mlx5_0", "mlx5_2"])], ports)
    assert status.problems == ["mlx5_0: no ACTIVE port (port 1 DOWN (Disabled): the port is disabled)",
                               "mlx5_2: no such adapter on this node"]


# ---- the simulated boxes are the real ones ---------------------------------------------------

REAL_TOPO = {
    "dgx-h100": "stas00-h100-8gpu-ht-tabs-expanded.txt",
    "hgx-a100": "stas00-a100-8gpu-nv12-respaced.txt",
    "roce-8nic": "sglang-issue24966-8xh20-nv18-8nic.txt",
}


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_profiles_nvlink_matches_a_real_box(profile):
    spec = NodeSpec(node_id="n-1", **{**BASE, **PROFILES[profile]})  # type: ignore[arg-type]
    plan = plan_node(spec)
    got = {g.index: g.nvlink for g in plan.gpu_file.gpus}
    if profile in REAL_TOPO:
        assert got == gputopo.nvlink_matrix((REAL / "nvidia-smi-topo" / REAL_TOPO[profile]).read_text())
    else:
        # The bridged box: GPU0-GPU1 NV4 as the RTX A6000 sample, and the next pair the same.
        real = gputopo.nvlink_matrix(
            (REAL / "nvidia-smi-topo" / "rtx-a6000-x3-nvlink-bridge-pair-plus-unbridged.txt").read_text())
        assert got[0] == real[0] and got[1] == real[1]
        assert got[2] == {3: 4} and got[3] == {2: 4}


def test_pairs_nvlink_on_an_odd_count_leaves_the_last_alone():
    assert nvlink_peers("pairs-nv4", 3, 2) == {}
    assert nvlink_peers("nv12", 3, 1) == {0: 12, 2: 12}


def test_roce_profile_writes_a_connectx_gid_table():
    plan = plan_node(NodeSpec(node_id="r-1", **{**BASE, **PROFILES["roce-8nic"]}))  # type: ignore[arg-type]
    port = "sys/class/infiniband/mlx5_0/ports/1"
    types = [plan.files[f"{port}/gid_attrs/types/{i}"].strip() for i in range(4)]
    assert types == ["IB/RoCE v1", "RoCE v2", "IB/RoCE v1", "RoCE v2"]
    assert plan.files[f"{port}/gids/3"].strip().startswith("0000:0000:0000:0000:0000:ffff:0a01:")


def test_absent_and_init_flags_reach_agent_yaml_and_sysfs(tmp_path):
    from llmgw.catalog.load import load_agent_config
    from llmgw.sim.node import write_node

    result = write_node(str(tmp_path / "n"),
                        NodeSpec(node_id="n-3", ib_ports=2, absent=["mlx5_7"], init_ports=["mlx5_1"]))
    cfg = load_agent_config(result.agent_config)
    assert [msgspec.structs.asdict(f) for f in declared.from_config(cfg.fabrics)] == [
        {"name": "ib", "kind": "infiniband", "devices": ["mlx5_0", "mlx5_1", "mlx5_7"]}]
    state = tmp_path / "n" / "sys" / "class" / "infiniband" / "mlx5_1" / "ports" / "1" / "state"
    assert state.read_text() == "2: INIT\n"


def test_fabric_devices_name_adapters_as_the_fabric_map_does():
    statuses = [FabricStatus(name="ib", kind="infiniband", usable=True, ports=["mlx5_10:1", "mlx5_2:1", "mlx5_2:2"]),
                FabricStatus(name="roce", kind="roce", usable=False, ports=["mlx5_4:1"])]
    assert declared.fabric_devices(statuses) == {"ib": ["mlx5_2", "mlx5_2/2", "mlx5_10"]}  # usable fabrics only
