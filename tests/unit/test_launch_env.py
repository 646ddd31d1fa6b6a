"""The environment an engine shard gets for NCCL and Gloo: derived from this node's discovery
(usable adapter ports, management interface, RoCE GID index), overridden only by the profile."""

from __future__ import annotations

import pytest

from llmgw.agent import launch_env, netif
from llmgw.fabric import declared, hca
from llmgw.wire.messages import FabricDecl, Port
from tests.realfixtures import REAL

CHRYSALIS = hca.parse_ibv_devinfo(
    (REAL / "ibv_devinfo" / "anl-chrysalis-hdr-cx6-ib-plus-2x-cx5-roce-verbose.txt").read_text())
DECLS = [FabricDecl(name="ib", devices=["mlx5_0"]), FabricDecl(name="roce", kind="roce", devices=["mlx5_1", "mlx5_2"])]
STATUSES = declared.check_fabrics(DECLS, CHRYSALIS)


def env_for(fabric: str, ports=CHRYSALIS, statuses=STATUSES, interface="bond0"):
    return launch_env.derive(launch_env.pick_fabric(fabric, statuses), ports, interface)


def test_infiniband_shard_gets_exact_adapter_ports_and_no_gid_index():
    assert env_for("ib") == {
        "NCCL_IB_HCA": "=mlx5_0:1",
        "NCCL_SOCKET_IFNAME": "=bond0",
        "GLOO_SOCKET_IFNAME": "bond0",
    }


def test_roce_shard_gets_the_v2_ipv4_gid_index_from_the_real_table():
    env = env_for("roce")
    assert env["NCCL_IB_HCA"] == "=mlx5_1:1,mlx5_2:1"
    assert env["NCCL_IB_GID_INDEX"] == "3"


def test_no_fabric_named_takes_the_first_usable_rdma_one():
    assert env_for("")["NCCL_IB_HCA"] == "=mlx5_0:1"
    assert env_for("", statuses=[])  == {"NCCL_SOCKET_IFNAME": "=bond0", "GLOO_SOCKET_IFNAME": "bond0"}


def test_unusable_or_unknown_fabric_refuses_the_launch():
    statuses = declared.check_fabrics([FabricDecl(name="ib", devices=["mlx5_0", "mlx5_9"])], CHRYSALIS)
    with pytest.raises(launch_env.LaunchError, match="fabric 'ib' is not usable on this node: mlx5_9: no such adapter"):
        env_for("ib", statuses=statuses)
    with pytest.raises(launch_env.LaunchError, match="fabric 'other' is not declared"):
        env_for("other")


def test_roce_port_without_ipv4_gid_refuses_rather_than_guess():
    ports = [Port(device="mlx5_1", port=1, link_layer="Ethernet", state="ACTIVE", rate_gbps=100.0)]
    statuses = declared.check_fabrics([FabricDecl(name="roce", kind="roce", devices=["mlx5_1"])], ports)
    with pytest.raises(launch_env.LaunchError, match="no RoCE v2 GID with an IPv4 address"):
        env_for("roce", ports=ports, statuses=statuses)


def test_profile_env_wins_and_the_report_says_so():
    derived = env_for("roce")
    profile = {"NCCL_IB_GID_INDEX": "5", "HF_TOKEN": "secret"}
    env = {"NCCL_IB_GID_INDEX": "5", "HF_TOKEN": "secret", "NCCL_IB_HCA": "from-the-agent-environment"}
    launch_env.apply(env, derived, profile)
    assert env["NCCL_IB_GID_INDEX"] == "5" and env["NCCL_IB_HCA"] == "=mlx5_1:1,mlx5_2:1"
    settings = {s.name: s for s in launch_env.settings(derived, profile)}
    assert settings["NCCL_IB_GID_INDEX"].overridden and settings["NCCL_IB_GID_INDEX"].derived == "3"
    assert settings["NCCL_IB_GID_INDEX"].value == "5"
    assert not settings["NCCL_IB_HCA"].overridden
    assert "HF_TOKEN" not in settings  # only the keys the agent derives are reported


def test_management_interface_is_the_one_holding_the_address():
    addresses = {"eth0": ["192.0.2.2"], "bond0": ["10.1.0.5", "fe80::1"], "ib0": ["10.2.0.5"], "lo": ["127.0.0.1"]}
    assert netif.choose_interface("10.1.0.5", addresses) == ("bond0", netif.HOW_ADDRESS)
    assert netif.choose_interface("fe80::1%bond0", addresses) == ("bond0", netif.HOW_ADDRESS)
    assert netif.choose_interface("203.0.113.9", addresses) == ("eth0", netif.HOW_FALLBACK)  # last resort
    assert netif.choose_interface("", addresses) == ("eth0", netif.HOW_FALLBACK)


def test_management_interface_on_this_machine_for_loopback():
    assert netif.management_interface("127.0.0.1") == ("lo", netif.HOW_ADDRESS)


def test_roce_ports_with_different_gid_indexes_launch_and_nccl_picks_per_device():
    # issue 38, item 9: NCCL >= 2.21 chooses the GID per device when NCCL_IB_GID_INDEX is unset
    # (NVIDIA/nccl v2.31.2-1 src/transport/net_ib/connect.cc: IB_GID_INDEX defaults to -1,
    # IB_ROCE_VERSION_NUM to 2), so one number for all ports is not needed and must not be forced.
    ports = [Port(device="mlx5_1", port=1, link_layer="Ethernet", state="ACTIVE", rate_gbps=100.0,
                  roce_v2_ipv4_gid_index=3),
             Port(device="mlx5_2", port=1, link_layer="Ethernet", state="ACTIVE", rate_gbps=100.0,
                  roce_v2_ipv4_gid_index=5)]
    statuses = declared.check_fabrics([FabricDecl(name="roce", kind="roce", devices=["mlx5_1", "mlx5_2"])], ports)
    env = env_for("roce", ports=ports, statuses=statuses)
    assert env["NCCL_IB_HCA"] == "=mlx5_1:1,mlx5_2:1"
    assert "NCCL_IB_GID_INDEX" not in env
    assert env["NCCL_IB_ROCE_VERSION_NUM"] == "2"


def test_a_profiles_nccl_ib_tc_is_reported_with_the_launch_env():
    report = {s.name: s for s in launch_env.settings(env_for("roce"), {"NCCL_IB_TC": "106"})}
    assert report["NCCL_IB_TC"].value == "106" and report["NCCL_IB_TC"].overridden
