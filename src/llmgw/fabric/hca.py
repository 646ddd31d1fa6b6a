"""`ibstat` and `ibv_devinfo` output → wire Ports. Pure: text in, values out.

The agent reads sysfs, not these tools; they are what an operator pastes (and what the real
samples in tests/fixtures/real are), so the fabric checks and the GID-index rule are tested on
what real adapters printed, through the same Port records sysfs gives.

- ibstat (infiniband-diags): `CA 'mlx5_0'` blocks, `Port 1:` sub-blocks, `State: Active |
  Initializing | Down | Armed`, `Physical state: LinkUp | Polling | Disabled`, `Rate: 200`
  (aggregate Gb/s), decimal LIDs, `Link layer: InfiniBand | Ethernet`.
- ibv_devinfo (rdma-core): `hca_id: mlx5_0`, `port: 1`, `state: PORT_ACTIVE (4)`,
  `phys_state: LINK_UP (5)`, `link_layer:`; with -v `active_width: 4X (2)`,
  `active_speed: 50.0 Gbps (64)` (per lane) and the GID table `GID[  3]: ::ffff:10.0.0.1, RoCE v2`.
"""

from __future__ import annotations

import re

from llmgw.fabric.sysfs import parse_guid, roce_v2_ipv4_gid_index
from llmgw.wire.messages import Port

_IBSTAT_STATES = {"active": "ACTIVE", "initializing": "INIT", "init": "INIT", "down": "DOWN", "armed": "ARMED"}
# `CA 'mlx5_0'` (ca_dump) or, for `ibstat mlx4_0 1`, `CA: 'mlx4_0'` with the port's lines unindented
# (ca_stat → port_dump(alone=1)): rdma-core infiniband-diags/ibstat.c @691953d8d. node_type_str
# also gives `Switch`, `Router`, `RNIC` and `???`.
_CA = re.compile(r"^(?:CA|Switch|Router|RNIC|\?\?\?):? '([^']+)'\s*$")
_PORT = re.compile(r"^Port (\d+):\s*$")


def parse_ibstat(text: str) -> list[Port]:
    ports: list[Port] = []
    device = ""
    guid = hca_type = fw = ""
    current: Port | None = None
    for raw in text.splitlines():
        line = raw.strip()
        ca = _CA.match(line)
        if ca:
            device, guid, hca_type, fw, current = ca[1], "", "", "", None
            continue
        port = _PORT.match(line)
        if port and device:
            current = Port(device=device, port=int(port[1]), node_guid=guid, hca_type=hca_type, fw_ver=fw)
            ports.append(current)
            continue
        key, sep, val = line.partition(":")
        if not sep:
            continue
        key, val = key.strip().lower(), val.strip()
        if current is None:
            if key == "node guid":
                guid = parse_guid(val)
            elif key == "ca type":
                hca_type = val
            elif key == "firmware version":
                fw = val
            continue
        if key == "state":
            current.state = _IBSTAT_STATES.get(val.lower(), val.upper())
        elif key == "physical state":
            current.phys_state = val
        elif key == "rate" and re.fullmatch(r"\d+(\.\d+)?", val):
            current.rate_gbps = float(val)
        elif key == "base lid" and val.isdigit():
            current.lid = int(val)
        elif key == "sm lid" and val.isdigit():
            current.sm_lid = int(val)
        elif key == "link layer":
            current.link_layer = val
    return ports


_PHYS = {"LINK_UP": "LinkUp", "POLLING": "Polling", "DISABLED": "Disabled", "SLEEP": "Sleep"}
_GID_LINE = re.compile(r"^GID\[\s*(\d+)\]:\s*(\S+?)(?:,\s*(.+))?$")


def parse_ibv_devinfo(text: str) -> list[Port]:
    """Ports of `ibv_devinfo` (plain or -v). A RoCE port's GID table sets roce_v2_ipv4_gid_index."""
    ports: list[Port] = []
    gids: dict[int, dict[int, tuple[str, str]]] = {}
    device = guid = fw = ""
    current: Port | None = None
    width = 0
    for raw in text.splitlines():
        line = raw.strip()
        key, sep, val = line.partition(":")
        key, val = key.strip(), val.strip()
        if key == "hca_id" and sep:
            device, guid, fw, current = val, "", "", None
            continue
        gid = _GID_LINE.match(line)
        if gid and current is not None:
            gids.setdefault(len(ports) - 1, {})[int(gid[1])] = (gid[2], gid[3] or "")
            continue
        if not sep:
            continue
        if key == "port" and val.isdigit() and device:
            current = Port(device=device, port=int(val), node_guid=guid, fw_ver=fw, state="", link_layer="InfiniBand")
            ports.append(current)
            width = 0
        elif current is None:
            if key == "node_guid":
                guid = parse_guid(val)
            elif key == "fw_ver":
                fw = val
        elif key == "state":
            current.state = val.split()[0].removeprefix("PORT_")
        elif key == "phys_state":
            name = val.split()[0]
            current.phys_state = _PHYS.get(name, name)
        elif key == "link_layer":
            current.link_layer = val
        elif key == "port_lid" and val.isdigit():
            current.lid = int(val)
        elif key == "sm_lid" and val.isdigit():
            current.sm_lid = int(val)
        elif key == "active_width":
            match = re.match(r"(\d+)X", val)
            width = int(match[1]) if match else 0
            current.width = f"{width}X" if width else ""
        elif key == "active_speed":
            match = re.match(r"(\d+(?:\.\d+)?)\s*Gbps", val)
            if match and width:
                current.rate_gbps = float(match[1]) * width
    for index, table in gids.items():
        port = ports[index]
        if table:
            port.gid = table.get(0, ("", ""))[0]
        if port.link_layer == "Ethernet":
            port.roce_v2_ipv4_gid_index = roce_v2_ipv4_gid_index(table)
    return ports
