"""sysfs port records → Port / PortCounters, on real trees copied from real nodes."""

from __future__ import annotations

import re

import pytest

from llmgw.fabric import sysfs
from tests.realfixtures import REAL, load_flat

NODE_EXPORTER = REAL / "sysfs" / "node-exporter-i40iw-mlx4.txt"
PROCFS = REAL / "sysfs" / "procfs-fixtures-hfi1-mlx4-mlx5.txt"



def by_key(ports):
    return {(p.device, p.port): p for p in ports}


# ---- whole fixture trees ---------------------------------------------------------------------


def test_every_port_of_node_exporter_tree_parses():
    ports = sysfs.ports_from_tree(load_flat(NODE_EXPORTER))
    assert [(p.device, p.port) for p in ports] == [("i40iw0", 1), ("mlx4_0", 1), ("mlx4_0", 2)]
    for port in ports:
        assert port.state == "ACTIVE"
        assert port.phys_state == "LinkUp"
        assert port.link_layer == "InfiniBand"
        assert port.rate_gbps > 0


def test_every_port_of_procfs_tree_parses():
    ports = sysfs.ports_from_tree(load_flat(PROCFS))
    assert [(p.device, p.port) for p in ports] == [
        ("hfi1_0", 1),
        ("mlx4_0", 1),
        ("mlx4_0", 2),
        ("mlx5_0", 1),
    ]
    for port in ports:
        assert port.state == "ACTIVE"
        assert port.link_layer == "InfiniBand"


def test_mlx4_qdr_port_values():
    port = by_key(sysfs.ports_from_tree(load_flat(NODE_EXPORTER)))[("mlx4_0", 1)]
    assert port.rate_gbps == 40.0
    assert port.width == "4X"
    assert port.speed == "QDR"
    assert port.state == "ACTIVE"
    assert port.phys_state == "LinkUp"
    # These fixtures have no lid, sm_lid, gids or node_guid files: defaults, not errors.
    assert (port.lid, port.sm_lid, port.gid, port.node_guid) == (0, 0, "", "")


def test_link_layer_followed_by_empty_line():
    files = load_flat(PROCFS)
    assert files["sys/class/infiniband/mlx4_0/ports/2/link_layer"] == "InfiniBand\n\n"
    port = by_key(sysfs.ports_from_tree(files))[("mlx4_0", 2)]
    assert port.link_layer == "InfiniBand"


def test_hfi1_omni_path_100g_edr():
    port = by_key(sysfs.ports_from_tree(load_flat(PROCFS)))[("hfi1_0", 1)]
    assert (port.rate_gbps, port.width, port.speed) == (100.0, "4X", "EDR")


def test_mlx5_1x_edr_with_colon_guid_and_odd_phys_state():
    port = by_key(sysfs.ports_from_tree(load_flat(PROCFS)))[("mlx5_0", 1)]
    assert (port.rate_gbps, port.width, port.speed) == (25.0, "1X", "EDR")
    assert port.node_guid == "0x0a7fbc1245efd23b"
    # The fixture says `4: ACTIVE` in phys_state; we report what the node says.
    assert port.phys_state == "ACTIVE"


def test_iwarp_rate_without_speed_name_and_counters_without_pma():
    files = load_flat(NODE_EXPORTER)
    port = by_key(sysfs.ports_from_tree(files))[("i40iw0", 1)]
    assert (port.rate_gbps, port.width, port.speed) == (10.0, "4X", "")
    assert (
        sysfs.parse_counter(files["sys/class/infiniband/i40iw0/ports/1/counters/symbol_error"])
        is None
    )
    counters = {(c.device, c.port): c for c in sysfs.counters_from_tree(files)}
    i40iw = counters[("i40iw0", 1)]
    # "N/A (no PMA)": unknown, which is not zero errors.
    assert (i40iw.symbol_error, i40iw.link_downed, i40iw.port_rcv_errors) == (None, None, None)
    assert i40iw.state == "ACTIVE"
    assert i40iw.rate_gbps == 10.0


def test_counters_from_real_tree():
    files = load_flat(NODE_EXPORTER)
    counters = sysfs.counters_from_tree(files)
    assert [(c.device, c.port) for c in counters] == [("i40iw0", 1), ("mlx4_0", 1), ("mlx4_0", 2)]
    assert all(c.rate_gbps > 0 for c in counters)
    base = "sys/class/infiniband/mlx4_0/ports/1/counters/"
    # 32-bit counter saturated, and a large 64-bit-ish one: both plain integers.
    assert sysfs.parse_counter(files[base + "port_xmit_wait"]) == 4294967295
    assert sysfs.parse_counter(files[base + "port_rcv_packets"]) == 6825908347


def test_counters_nonzero_reach_port_counters():
    files = {
        "class/infiniband/mlx5_3/ports/1/state": "4: ACTIVE\n",
        "class/infiniband/mlx5_3/ports/1/counters/symbol_error": "1873\n",
        "class/infiniband/mlx5_3/ports/1/counters/link_downed": "2\n",
        "class/infiniband/mlx5_3/ports/1/counters/port_rcv_errors": "N/A (no PMA)\n",
    }
    [c] = sysfs.counters_from_tree(files)
    assert (c.symbol_error, c.link_downed, c.port_rcv_errors) == (1873, 2, None)


# ---- ibstatus / ibstat: the same strings ------------------------------------------------------


def test_ibstatus_connectx3_qdr_and_eth_down():
    ports = sysfs.parse_ibstatus(
        (REAL / "ibstat" / "ibstatus-connectx3-qdr-plus-eth-down.txt").read_text()
    )
    assert len(ports) == 2
    p1, p2 = ports
    assert (p1.device, p1.port, p1.state, p1.phys_state) == ("mlx4_0", 1, "ACTIVE", "LinkUp")
    assert (p1.rate_gbps, p1.width, p1.speed, p1.link_layer) == (40.0, "4X", "QDR", "InfiniBand")
    assert (p1.lid, p1.sm_lid) == (0xA, 0xC)
    assert p1.gid == "fe80:0000:0000:0000:f452:1403:0091:ba11"
    assert (p2.state, p2.phys_state, p2.link_layer) == ("DOWN", "Disabled", "Ethernet")
    assert (p2.rate_gbps, p2.width, p2.speed) == (10.0, "1X", "QDR")


def test_ibstatus_ndr200_2x_hex_lid():
    [port] = sysfs.parse_ibstatus(
        (REAL / "ibstat" / "ibstatus-ndr200-2x-cx7-redacted-gid.txt").read_text()
    )
    assert (port.device, port.port) == ("mlx5_7", 1)
    assert (port.rate_gbps, port.width, port.speed) == (200.0, "2X", "NDR")
    assert (port.lid, port.sm_lid) == (0x6C, 4)
    assert port.gid == "fe80:0000:0000:0000:<redacted>"


def test_ibstat_bare_rates():
    rates: list[float] = []
    for path in sorted((REAL / "ibstat").glob("*.txt")):
        if path.name.startswith("ibstatus"):
            continue
        for match in re.finditer(r"^\s*Rate:\s*(\S+)\s*$", path.read_text(), re.M):
            rate = sysfs.parse_rate(match[1])
            assert rate.gbps > 0, (path.name, match[0])
            assert rate.width == ""
            rates.append(rate.gbps)
    assert {10.0, 40.0, 56.0, 100.0, 200.0} <= set(rates)


def test_ibstat_base_lid_is_decimal():
    text = (REAL / "ibstat" / "ibstat-hdr-cx6-mt4123-rate200.txt").read_text()
    lid = re.search(r"Base lid:\s*(\S+)", text)[1]
    assert sysfs.parse_lid(lid) == 17


# ---- single values ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("100 Gb/sec (4X EDR)\n", (100.0, "4X", "EDR")),
        ("10 Gb/sec (4X)", (10.0, "4X", "")),
        ("200 Gb/sec (2X NDR)", (200.0, "2X", "NDR")),
        ("2.5 Gb/sec (1X SDR)", (2.5, "1X", "SDR")),
        ("56 Gb/sec (4X FDR)", (56.0, "4X", "FDR")),
        ("40 Gb/sec (4X FDR10)", (40.0, "4X", "FDR10")),
        ("800 Gb/sec (4X XDR)", (800.0, "4X", "XDR")),
        ("40", (40.0, "", "")),
        ("", (0.0, "", "")),
        ("Invalid argument", (0.0, "", "")),
    ],
)
def test_parse_rate(text, expected):
    assert tuple(sysfs.parse_rate(text)) == expected


@pytest.mark.parametrize("speed", list(sysfs.LANE_GBPS))
@pytest.mark.parametrize("width", [1, 2, 4, 8, 12])
def test_format_rate_round_trips(width, speed):
    rate = sysfs.parse_rate(sysfs.format_rate(width, speed))
    assert rate == (sysfs.LANE_GBPS[speed] * width, f"{width}X", speed)


def test_format_rate_matches_kernel_strings():
    assert sysfs.format_rate(4, "NDR") == "400 Gb/sec (4X NDR)"
    assert sysfs.format_rate(1, "SDR") == "2.5 Gb/sec (1X SDR)"
    assert sysfs.format_rate(4, "FDR") == "56 Gb/sec (4X FDR)"


@pytest.mark.parametrize(
    ("text", "state"),
    [
        ("4: ACTIVE\n", "ACTIVE"),
        ("1: DOWN", "DOWN"),
        ("2: INIT", "INIT"),
        ("3", "ARMED"),
        ("", ""),
        ("weird", "weird"),
    ],
)
def test_parse_state(text, state):
    assert sysfs.parse_state(text) == state


@pytest.mark.parametrize(
    ("text", "phys"),
    [
        ("5: LinkUp", "LinkUp"),
        ("2: Polling\n", "Polling"),
        ("3: Disabled", "Disabled"),
        ("7", "Phy Test"),
    ],
)
def test_parse_phys_state(text, phys):
    assert sysfs.parse_phys_state(text) == phys


@pytest.mark.parametrize(
    ("text", "lid"), [("0x6c\n", 108), ("0xa", 10), ("0x0", 0), ("17", 17), ("", 0), ("zz", 0)]
)
def test_parse_lid(text, lid):
    assert sysfs.parse_lid(text) == lid


@pytest.mark.parametrize(
    ("text", "guid"),
    [
        ("0002:c903:0031:7d90\n", "0x0002c90300317d90"),
        ("0x7cfe9003003b4bde", "0x7cfe9003003b4bde"),
        ("0x2c90200259201", "0x0002c90200259201"),
        ("not a guid", ""),
        ("0002:c903:0031:7d90:ffff", ""),
        ("", ""),
    ],
)
def test_parse_guid(text, guid):
    assert sysfs.parse_guid(text) == guid


def test_natural_order_and_netdevs():
    files = {
        f"/sys/class/infiniband/mlx5_{n}/ports/1/rate": "400 Gb/sec (4X NDR)\n" for n in (10, 2, 1)
    }
    ports = sysfs.ports_from_tree(files, netdevs={("mlx5_2", 1): "ib2"})
    assert [p.device for p in ports] == ["mlx5_1", "mlx5_2", "mlx5_10"]
    assert [p.netdev for p in ports] == ["", "ib2", ""]
