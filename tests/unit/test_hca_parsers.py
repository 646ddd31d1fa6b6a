"""ibstat, ibv_devinfo, nvidia-smi topo and sysfs counters, parsed from what real adapters and
boxes printed (tests/fixtures/real, see SOURCES.md)."""

from __future__ import annotations

import pytest

from llmgw.fabric import gputopo, hca, sysfs
from tests.realfixtures import REAL, load_flat


def ports_of(ports):
    return {(p.device, p.port): p for p in ports}


def test_ibstat_initializing_port_without_subnet_manager():
    [port] = hca.parse_ibstat((REAL / "ibstat" / "connectx3-qdr-initializing-no-sm.txt").read_text())
    assert (port.device, port.port, port.state, port.phys_state) == ("mlx4_0", 1, "INIT", "LinkUp")
    assert port.lid == 0 and port.sm_lid == 0
    assert port.rate_gbps == 40.0


def test_ibstat_mixed_rates_and_link_layers():
    ports = ports_of(hca.parse_ibstat((REAL / "ibstat" / "nersc-8x-connectx5-edr-fdr-eth.txt").read_text()))
    assert ports["mlx4_0", 1].link_layer == "Ethernet"
    assert ports["mlx5_0", 1].rate_gbps == 100.0 and ports["mlx5_1", 1].rate_gbps == 56.0
    assert ports["mlx5_0", 1].node_guid == "0x506b4b0300f9f8ea"
    assert all(p.state == "ACTIVE" for p in ports.values())


def test_ibv_devinfo_verbose_roce_gid_tables():
    ports = ports_of(hca.parse_ibv_devinfo(
        (REAL / "ibv_devinfo" / "anl-chrysalis-hdr-cx6-ib-plus-2x-cx5-roce-verbose.txt").read_text()))
    ib = ports["mlx5_0", 1]
    assert (ib.link_layer, ib.state, ib.phys_state, ib.rate_gbps) == ("InfiniBand", "ACTIVE", "LinkUp", 200.0)
    assert ib.roce_v2_ipv4_gid_index == -1  # no GID index on InfiniBand
    for device in ("mlx5_1", "mlx5_2"):
        roce = ports[device, 1]
        assert roce.link_layer == "Ethernet"
        # GID[  3]: ::ffff:140.221.60.11, RoCE v2 (index 2 holds the same address as RoCE v1)
        assert roce.roce_v2_ipv4_gid_index == 3


def test_ibv_devinfo_plain_port_down_on_ethernet():
    ports = ports_of(hca.parse_ibv_devinfo(
        (REAL / "ibv_devinfo" / "connectx3-qdr-ib-port-plus-eth-port-down.txt").read_text()))
    assert ports["mlx4_0", 1].state == "ACTIVE" and ports["mlx4_0", 1].link_layer == "InfiniBand"
    assert ports["mlx4_0", 2].state == "DOWN" and ports["mlx4_0", 2].link_layer == "Ethernet"
    assert ports["mlx4_0", 2].roce_v2_ipv4_gid_index == -1


@pytest.mark.parametrize(("table", "index"), [
    ({0: ("fe80::1", "IB/RoCE v1"), 1: ("fe80::1", "RoCE v2"),
      2: ("0000:0000:0000:0000:0000:ffff:0a3c:200b", "IB/RoCE v1"), 3: ("::ffff:10.60.32.11", "RoCE v2")}, 3),
    ({0: ("fe80::1", "IB/RoCE v1"), 1: ("fe80::1", "RoCE v2")}, -1),  # no IPv4 address on the netdev
    ({0: ("::ffff:10.0.0.1", "IB/RoCE v1")}, -1),  # v1 only: not routable
    ({5: ("0000:0000:0000:0000:0000:ffff:0a00:0001", "RoCE v2\n"), 7: ("::ffff:10.0.0.2", "RoCE v2")}, 5),
])
def test_roce_v2_ipv4_gid_index(table, index):
    assert sysfs.roce_v2_ipv4_gid_index(table) == index


def test_counters_not_available_are_values_not_zeros():
    counters = {(c.device, c.port): c for c in sysfs.counters_from_tree(
        load_flat(REAL / "sysfs" / "node-exporter-i40iw-mlx4.txt"))}
    iwarp = counters["i40iw0", 1]
    assert iwarp.state == "ACTIVE"
    assert iwarp.counters and all(v is None for v in iwarp.counters.values())  # N/A (no PMA)
    assert iwarp.symbol_error is None
    mlx4 = counters["mlx4_0", 1]
    assert mlx4.counters["port_xmit_data"] == 3733440
    assert mlx4.counters["port_rcv_data"] == 4631917
    assert mlx4.counters["port_rcv_packets"] == 6825908347
    assert mlx4.counters["port_xmit_packets"] == 6235865
    assert mlx4.counters["port_xmit_data_64"] == 3733440  # counters_ext
    assert mlx4.counters["port_xmit_wait"] == 4294967295
    assert len(mlx4.counters) <= sysfs.MAX_COUNTERS


@pytest.mark.parametrize(("name", "gpus", "matrix"), [
    ("stas00-h100-8gpu-ht-tabs-expanded.txt", 8, "all:18"),
    ("stas00-a100-8gpu-nv12-respaced.txt", 8, "all:12"),
    ("sglang-issue24966-8xh20-nv18-8nic.txt", 8, "all:18"),
    ("alcf-polaris-4xa100-nv4-2nic-header-mangled.txt", 4, "all:4"),
    ("princeton-traverse-power9-4xv100-nv3-4nic.txt", 4, "pairs:3"),
    ("rtx-a6000-x3-nvlink-bridge-pair-plus-unbridged.txt", 3, "pairs:4"),
    ("stas00-2gpu-phb-no-nvlink-tabs-expanded.txt", 2, "none"),
    ("princeton-della-2xa100-pcie-2nic-sys.txt", 2, "none"),
    ("llmgw-device-1xh200-vm-ansi-header.txt", 1, "none"),
])
def test_nvidia_smi_topo_nvlink_matrix(name, gpus, matrix):
    got = gputopo.nvlink_matrix((REAL / "nvidia-smi-topo" / name).read_text())
    assert sorted(got) == list(range(gpus))
    kind, _, links = matrix.partition(":")
    for gpu, peers in got.items():
        if kind == "all":
            assert peers == {p: int(links) for p in range(gpus) if p != gpu}
        elif kind == "pairs":
            assert peers == ({gpu ^ 1: int(links)} if gpu ^ 1 < gpus else {})
        else:
            assert peers == {}
