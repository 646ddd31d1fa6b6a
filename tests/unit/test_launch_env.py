"""The environment an engine shard gets for NCCL and Gloo: derived from this node's discovery
(usable adapter ports, management interface, RoCE GID index), overridden only by the profile."""

from __future__ import annotations

import pytest

from llmgw import netaddr
from llmgw.agent import launch_env, netif
from llmgw.fabric import declared, hca
from llmgw.wire.messages import FabricDecl, Port, ShardSpec
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
    assert netaddr.choose_interface("10.1.0.5", addresses) == ("bond0", netaddr.HOW_ADDRESS)
    assert netaddr.choose_interface("fe80::1%bond0", addresses) == ("bond0", netaddr.HOW_ADDRESS)
    # No interface holds it: none is guessed (eth0 was, before issue 38; a multi-node launch is refused).
    assert netaddr.choose_interface("203.0.113.9", addresses) == ("", netaddr.HOW_NONE)
    assert netaddr.choose_interface("", addresses) == ("", netaddr.HOW_NONE)
    assert netaddr.holding(["203.0.113.9", "10.2.0.5"], addresses) == ("ib0", "10.2.0.5")


def test_management_interface_on_this_machine_for_loopback():
    assert netif.management_interface("127.0.0.1") == ("lo", "127.0.0.1", netif.HOW_ADDRESS)
    assert netif.management_interface("localhost")[0] == "lo"  # a name is resolved
    assert netif.management_interface("192.0.2.77") == ("", "", netif.HOW_NONE)  # TEST-NET-1: held by nobody


# ---- one address per node: advertise_host, the master address, the socket interface -------------

TABLE = {"lo": ["127.0.0.1"], "bond0": ["10.1.0.5"], "eth0": ["192.0.2.2"]}


def facts(address: str = "10.1.0.5", host: str = "") -> launch_env.LaunchFacts:
    interface, held = netaddr.holding([address], TABLE)
    return launch_env.LaunchFacts(interface=interface, address=held, advertise_host=host or address, interfaces=TABLE)


def rank(r: int, master: str = "10.1.0.5", world: int = 2, engine: str = "vllm") -> ShardSpec:
    return ShardSpec(shard_id=f"big-x.1.{r}", replica_id="big-x", model="big", profile="p", engine=engine, rank=r,
                     world=world, gpus=[0], port=20001, master_addr=master, master_port=20002)


def test_every_rank_gets_its_nodes_address_and_the_pci_gpu_order():
    assert launch_env.node_env("vllm", facts()) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "VLLM_HOST_IP": "10.1.0.5"}
    assert launch_env.node_env("sglang", facts()) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "SGLANG_HOST_IP": "10.1.0.5"}
    assert launch_env.node_env("command", facts()) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    # A name in advertise_host: the address the interface holds, never the name (VLLM_HOST_IP is an IP).
    assert launch_env.node_env("sim", facts(host="gpu-01.example"))["VLLM_HOST_IP"] == "10.1.0.5"
    # No interface holds it: no address is announced (a single-node engine needs none).
    assert launch_env.node_env("vllm", facts("203.0.113.9")) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_a_multinode_rank_whose_address_no_interface_holds_is_refused():
    launch_env.check_address(rank(0, world=1), facts("203.0.113.9"))  # one node: NCCL finds its peers anywhere
    with pytest.raises(launch_env.LaunchError, match=r"advertise_host 203.0.113.9 is on no interface here "
                       r"\(interfaces: bond0 10.1.0.5; eth0 192.0.2.2; lo 127.0.0.1\)"):
        launch_env.check_address(rank(1), facts("203.0.113.9"))


def test_rank_0s_master_address_must_be_its_own_advertise_host():
    launch_env.check_address(rank(0), facts())
    launch_env.check_address(rank(0, master="gpu-01.example"), facts(host="gpu-01.example"))
    with pytest.raises(launch_env.LaunchError, match=r"master address 192.0.2.2 \(from the server\) is not this "
                       r"node's advertise_host 10.1.0.5 \(10.1.0.5 on bond0\) but on eth0"):
        launch_env.check_address(rank(0, master="192.0.2.2"), facts())


def test_loopback_on_one_side_of_a_pair_is_refused_on_both_ends():
    launch_env.check_address(rank(1, master="127.0.0.1"), facts("127.0.0.1"))  # every node on this machine: a lab
    launch_env.check_address(rank(1), facts("10.1.0.5"))
    with pytest.raises(launch_env.LaunchError, match=r"this node's advertise_host 127\.0\.0\.1 is a loopback address"):
        launch_env.check_address(rank(1, master="10.9.0.1"), facts("127.0.0.1"))
    with pytest.raises(launch_env.LaunchError, match=r"rank 0's node advertises a loopback address \(127.0.0.1\)"):
        launch_env.check_address(rank(1, master="127.0.0.1"), facts("10.1.0.5"))


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
