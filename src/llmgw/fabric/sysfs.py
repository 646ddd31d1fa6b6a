"""Parse sysfs RDMA port records (/sys/class/infiniband/<dev>/ports/<n>/*) into wire Structs.

Pure: the caller reads the files and hands over their text; nothing here touches a disk, so
the same code parses a live node, a simulated node and the fixtures copied from real ones.
`ibstatus` prints the same strings as sysfs (it is a shell script over these files), so it is
parsed here too.

Formats (kernel drivers/infiniband/core/sysfs.c): `state` "4: ACTIVE", `phys_state`
"5: LinkUp", `rate` "100 Gb/sec (4X EDR)" (old kernels and iWARP: "10 Gb/sec (4X)"; half rates
"2.5 Gb/sec (1X SDR)"), `lid` / `sm_lid` hex "0x6c", `gids/0` "fe80:0000:...", `node_guid`
"0002:c903:0031:7d90", counters decimal or "N/A (no PMA)" when the port has no PMA.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from llmgw.fabric.linkrate import parse_pcie_speed, parse_pcie_width
from llmgw.wire.messages import Port, PortCounters

# Port-relative files discovery reads for the inventory and for heartbeats. Keep them short:
# heartbeats read COUNTER_FILES for every port every few seconds.
PORT_FILES: tuple[str, ...] = (
    "state",
    "phys_state",
    "rate",
    "link_layer",
    "lid",
    "sm_lid",
    "gids/0",
    "gid_attrs/types/0",
)
COUNTER_FILES: tuple[str, ...] = ("state", "phys_state", "rate")
# Heartbeats also read every file in these port subdirectories (error and data counters;
# counters_ext holds the 64-bit data counters of older HCAs).
COUNTER_DIRS: tuple[str, ...] = ("counters", "counters_ext")
# The most counters one port reports (mlx5 has ~30 across both dirs): a bound on what a node
# can make the server keep and export.
MAX_COUNTERS = 64
# RDMA hw_counters (mlx5: ~30 Q and congestion counters on a port; the kernel's
# Documentation/ABI/stable/sysfs-class-infiniband). `lifespan` is not a counter: the milliseconds
# the driver caches the values for.
HW_COUNTER_DIR = "hw_counters"
HW_NOT_COUNTERS = frozenset({"lifespan"})
DEVICE_FILES: tuple[str, ...] = ("node_guid", "hca_type", "fw_ver")
# The HCA's PCI function (`<dev>/device/`, pci-sysfs): its PCIe link now and at best (fabric/linkrate.py).
PCIE_FILES: tuple[str, ...] = ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width")

# enum ib_port_state and enum ib_port_phys_state, as the kernel names them.
PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
PHYS_STATES = {
    1: "Sleep",
    2: "Polling",
    3: "Disabled",
    4: "PortConfigurationTraining",
    5: "LinkUp",
    6: "LinkErrorRecovery",
    7: "Phy Test",
}
# Per-lane rate in Gb/s of each speed name, as the kernel computes `rate`.
LANE_GBPS = {
    "SDR": 2.5,
    "DDR": 5.0,
    "QDR": 10.0,
    "FDR10": 10.0,
    "FDR": 14.0,
    "EDR": 25.0,
    "HDR": 50.0,
    "NDR": 100.0,
    "XDR": 200.0,
}


class Rate(NamedTuple):
    gbps: float
    width: str  # "4X", "" if not shown
    speed: str  # "EDR", "" if not shown (old kernels print no name for SDR)


def value(text: str | None) -> str:
    """The meaningful line of a sysfs file: first non-blank line, stripped.

    A fixture copied from a real tree has `InfiniBand` followed by an empty line; sysfs
    itself ends every value with a newline.
    """
    if not text:
        return ""
    for line in text.splitlines():
        line = line.strip()
        if line:
            return line
    return ""


def _parse_coded(text: str | None, names: Mapping[int, str]) -> tuple[int | None, str]:
    raw = value(text)
    if not raw:
        return None, ""
    code_text, sep, name = raw.partition(":")
    code_text = code_text.strip()
    if sep and code_text.isdigit():
        code = int(code_text)
        return code, name.strip() or names.get(code, "")
    if raw.isdigit():
        code = int(raw)
        return code, names.get(code, raw)
    return None, raw


def parse_state(text: str | None) -> str:
    """`4: ACTIVE` → `ACTIVE` (the name as written; a bare number is named from the enum)."""
    return _parse_coded(text, PORT_STATES)[1]


def parse_phys_state(text: str | None) -> str:
    """`5: LinkUp` → `LinkUp`.

    The name is taken as written, not re-derived from the code: a real fixture has
    `4: ACTIVE` in phys_state, and we report what the node says rather than guess.
    """
    return _parse_coded(text, PHYS_STATES)[1]


_RATE = re.compile(
    r"^\s*(?P<gbps>\d+(?:\.\d+)?)\s*(?:Gb/sec)?\s*"
    r"(?:\(\s*(?P<width>\d+)\s*[xX]\s*(?P<speed>[A-Za-z][A-Za-z0-9]*)?\s*\))?\s*$"
)


def parse_rate(text: str | None) -> Rate:
    """`100 Gb/sec (4X EDR)` → Rate(100.0, "4X", "EDR"); `10 Gb/sec (4X)` → Rate(10.0, "4X", "").

    A bare number (ibstat's `Rate: 40`) gives the aggregate only. Anything else → zeros.
    """
    match = _RATE.match(value(text))
    if not match:
        return Rate(0.0, "", "")
    width = f"{match['width']}X" if match["width"] else ""
    return Rate(float(match["gbps"]), width, (match["speed"] or "").upper())


def format_rate(width: int, speed: str) -> str:
    """The kernel's rate string for a width and speed name: (4, "NDR") → `400 Gb/sec (4X NDR)`."""
    tenths = round(LANE_GBPS[speed] * 10) * width
    half = ".5" if tenths % 10 else ""
    return f"{tenths // 10}{half} Gb/sec ({width}X {speed})"


def parse_lid(text: str | None) -> int:
    """`0x6c` → 108 (sysfs and ibstatus print hex); `17` → 17 (ibstat prints decimal)."""
    raw = value(text).lower()
    try:
        return int(raw, 16) if raw.startswith("0x") else int(raw, 10)
    except ValueError:
        return 0


def parse_counter(text: str | None) -> int | None:
    """A port counter; None when the port cannot count (`N/A (no PMA)`) or the text is not a number."""
    raw = value(text)
    return int(raw) if raw.isdigit() else None


_HEX = re.compile(r"^[0-9a-f]+$")


def parse_guid(text: str | None) -> str:
    """`0002:c903:0031:7d90` (sysfs) or `0x0002c90300317d90` (ibstat) → `0x0002c90300317d90`.

    One spelling for every source, so that GUIDs from sysfs, ibstat and ibnetdiscover compare
    equal as strings. Empty when the text is not a 64-bit GUID.
    """
    raw = value(text).lower().removeprefix("0x").replace(":", "")
    if not raw or len(raw) > 16 or not _HEX.match(raw):
        return ""
    return f"0x{int(raw, 16):016x}"


def parse_port(
    device: str,
    port: int,
    files: Mapping[str, str],
    *,
    node_guid: str = "",
    netdev: str = "",
    hca_type: str = "",
    fw_ver: str = "",
    pcie: Mapping[str, str] | None = None,
) -> Port:
    """One port from its files, keyed by path relative to the port dir (see PORT_FILES).

    A missing file leaves the field at its default: sysfs on old kernels has no link_layer
    (it was always InfiniBand then), and RoCE ports have no meaningful lid.
    """
    rate = parse_rate(files.get("rate"))
    link_layer = value(files.get("link_layer")) or "InfiniBand"
    pci = pcie or {}
    return Port(
        device=device,
        port=port,
        link_layer=link_layer,
        state=parse_state(files.get("state")),
        phys_state=parse_phys_state(files.get("phys_state")),
        rate_gbps=rate.gbps,
        width=rate.width,
        speed=rate.speed,
        lid=parse_lid(files.get("lid")),
        sm_lid=parse_lid(files.get("sm_lid")),
        gid=value(files.get("gids/0")),
        gid_type=value(files.get("gid_attrs/types/0")),
        node_guid=parse_guid(node_guid),
        netdev=netdev,
        hca_type=value(hca_type),
        fw_ver=value(fw_ver),
        roce_v2_ipv4_gid_index=roce_v2_ipv4_gid_index(gid_table(files)) if link_layer == "Ethernet" else -1,
        pcie_speed_gts=parse_pcie_speed(value(pci.get("current_link_speed"))),
        pcie_width=parse_pcie_width(value(pci.get("current_link_width"))),
        pcie_max_speed_gts=parse_pcie_speed(value(pci.get("max_link_speed"))),
        pcie_max_width=parse_pcie_width(value(pci.get("max_link_width"))),
    )


_COUNTER_NAME = re.compile(r"^[A-Za-z0-9_]{1,64}$")


def parse_port_counters(device: str, port: int, files: Mapping[str, str]) -> PortCounters:
    """Heartbeat view of a port: COUNTER_FILES plus every `counters/*` and `counters_ext/*` file,
    and `hw_counters/*` apart (their names are the driver's, not the IB spec's).

    A counter the port cannot read (`N/A (no PMA)`) is None: a value, not a zero and not an error.
    Counters are keyed by file name; a name in both dirs keeps the counters_ext one (64 bits).
    """
    counters: dict[str, int | None] = {}
    for directory in COUNTER_DIRS:
        prefix = directory + "/"
        for path in sorted(files):
            name = path[len(prefix):] if path.startswith(prefix) else ""
            if _COUNTER_NAME.match(name) and (name in counters or len(counters) < MAX_COUNTERS):
                counters[name] = parse_counter(files[path])
    hw: dict[str, int | None] = {}
    prefix = HW_COUNTER_DIR + "/"
    for path in sorted(files):
        name = path[len(prefix):] if path.startswith(prefix) else ""
        if _COUNTER_NAME.match(name) and name not in HW_NOT_COUNTERS and len(hw) < MAX_COUNTERS:
            hw[name] = parse_counter(files[path])
    return PortCounters(
        device=device,
        port=port,
        state=parse_state(files.get("state")),
        phys_state=parse_phys_state(files.get("phys_state")),
        rate_gbps=parse_rate(files.get("rate")).gbps,
        symbol_error=counters.get("symbol_error"),
        link_downed=counters.get("link_downed"),
        port_rcv_errors=counters.get("port_rcv_errors"),
        counters=counters,
        hw_counters=hw,
    )


def ipv4_mapped(gid: str) -> str:
    """The IPv4 address inside an IPv4-mapped GID, in any spelling sysfs or ibv_devinfo uses
    (`0000:0000:0000:0000:0000:ffff:8cdd:3c0b`, `::ffff:140.221.60.11`); "" if it is not one."""
    try:
        mapped = ipaddress.IPv6Address(gid.strip()).ipv4_mapped
    except ValueError:
        return ""
    return str(mapped) if mapped is not None else ""


def roce_v2_ipv4_gid_index(table: Mapping[int, tuple[str, str]]) -> int:
    """The GID index NCCL_IB_GID_INDEX wants on RoCE: the lowest index whose type is `RoCE v2`
    and whose GID holds an IPv4-mapped address; -1 if none.

    `table` maps index → (GID, type) as `gids/N` and `gid_attrs/types/N` give them (or
    `ibv_devinfo -v`'s `GID[  3]: ::ffff:10.0.0.1, RoCE v2`). On a ConnectX port with one IPv4
    address the kernel fills 0: v1 link-local, 1: v2 link-local, 2: v1 IPv4, 3: v2 IPv4.
    """
    for index in sorted(table):
        gid, kind = table[index]
        if value(kind).lower() == "roce v2" and ipv4_mapped(value(gid)) not in ("", "0.0.0.0"):
            return index
    return -1


def gid_table(files: Mapping[str, str]) -> dict[int, tuple[str, str]]:
    """index → (GID, type) from a port's `gids/N` and `gid_attrs/types/N` files."""
    table: dict[int, tuple[str, str]] = {}
    for path, text in files.items():
        if path.startswith("gids/") and path[5:].isdigit():
            index = int(path[5:])
            table[index] = (value(text), value(files.get(f"gid_attrs/types/{index}")))
    return table


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that puts mlx5_10 after mlx5_9."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", text) if part
    )


_TREE_PATH = re.compile(r"(?:^|/)class/infiniband/([^/]+)/(.+)$")
_PORT_PATH = re.compile(r"^ports/(\d+)/(.+)$")


class _Tree(NamedTuple):
    devices: dict[str, dict[str, str]]
    ports: dict[tuple[str, int], dict[str, str]]


def _group(files: Mapping[str, str]) -> _Tree:
    devices: dict[str, dict[str, str]] = {}
    ports: dict[tuple[str, int], dict[str, str]] = {}
    for path, text in files.items():
        match = _TREE_PATH.search(path)
        if not match:
            continue
        device, rest = match.groups()
        devices.setdefault(device, {})
        port_match = _PORT_PATH.match(rest)
        if port_match:
            ports.setdefault((device, int(port_match[1])), {})[port_match[2]] = text
        else:
            devices[device][rest] = text
    return _Tree(devices, ports)


def _sorted_ports(keys: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    return sorted(keys, key=lambda k: (natural_key(k[0]), k[1]))


def ports_from_tree(
    files: Mapping[str, str], netdevs: Mapping[tuple[str, int], str] | None = None
) -> list[Port]:
    """Every port in a set of sysfs files keyed by path (`…/class/infiniband/<dev>/ports/<n>/<file>`).

    Paths may start anywhere above `class/` (`/sys/class/…`, `sys/class/…`, `class/…`).
    """
    tree = _group(files)
    netdevs = netdevs or {}
    return [
        parse_port(
            device,
            port,
            tree.ports[(device, port)],
            node_guid=tree.devices.get(device, {}).get("node_guid", ""),
            netdev=netdevs.get((device, port), ""),
            hca_type=tree.devices.get(device, {}).get("hca_type", ""),
            fw_ver=tree.devices.get(device, {}).get("fw_ver", ""),
        )
        for device, port in _sorted_ports(tree.ports)
    ]


def counters_from_tree(files: Mapping[str, str]) -> list[PortCounters]:
    """Every port's heartbeat counters in a set of sysfs files keyed by path."""
    tree = _group(files)
    return [
        parse_port_counters(device, port, tree.ports[(device, port)])
        for device, port in _sorted_ports(tree.ports)
    ]


_IBSTATUS_HEADER = re.compile(r"^Infiniband device '([^']+)' port (\d+) status:\s*$")
_IBSTATUS_KEYS = {
    "default gid": "gids/0",
    "base lid": "lid",
    "sm lid": "sm_lid",
    "state": "state",
    "phys state": "phys_state",
    "rate": "rate",
    "link_layer": "link_layer",
}


def parse_ibstatus(text: str) -> list[Port]:
    """`ibstatus` output → ports. It prints the sysfs strings, so the same parsers apply."""
    blocks: list[tuple[str, int, dict[str, str]]] = []
    for line in text.splitlines():
        header = _IBSTATUS_HEADER.match(line.strip())
        if header:
            blocks.append((header[1], int(header[2]), {}))
            continue
        key, sep, rest = line.partition(":")
        name = _IBSTATUS_KEYS.get(key.strip().lower())
        if sep and name and blocks:
            blocks[-1][2][name] = rest.strip()
    return [parse_port(device, port, fields) for device, port, fields in blocks]
