"""Simulated traffic: the byte and packet counters in simulated nodes' fake sysfs advance as if their
engines talked over their InfiniBand ports, so the fabric page's particles move in `llmgw demo`.

Each port carries a load that drifts between 5 % and 60 % of its rate (a slow wave, a different
phase per node and device, so the picture is not uniform), counted the way the hardware counts:
`port_xmit_data`/`port_rcv_data` in 32-bit words (octets / 4), packets at 4 KiB each. The agent's
real discovery code reads the files as it reads a real node's.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

from llmgw.fabric import sysfs
from llmgw.fsutil import write_atomic

PACKET = 4096


def load(node_device: str, now: float) -> float:
    """The share of its rate a port carries at `now` (0.05-0.6)."""
    phase = (zlib.crc32(node_device.encode()) % 1000) / 1000 * 2 * math.pi
    return 0.05 + 0.55 * (0.5 + 0.5 * math.sin(now / 15 + phase))


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def advance(sysfs_roots: list[Path], seconds: float, now: float) -> int:
    """Add `seconds` of traffic to every InfiniBand port under the roots; how many ports moved."""
    moved = 0
    for root in sysfs_roots:
        for counters in sorted(root.glob("class/infiniband/*/ports/*/counters")):
            port_dir = counters.parent
            try:
                gbps = sysfs.parse_rate((port_dir / "rate").read_text()).gbps
            except (OSError, ValueError):
                continue
            if not gbps:
                continue
            for direction, skew in (("xmit", 0.0), ("rcv", 0.37)):
                share = load(f"{root}:{port_dir.parent.parent.name}:{direction}", now + skew * 40)
                octets = int(gbps * 1e9 / 8 * share * seconds)
                data, packets = counters / f"port_{direction}_data", counters / f"port_{direction}_packets"
                write_atomic(data, b"%d\n" % (_read_int(data) + octets // 4), replace=True)
                write_atomic(packets, b"%d\n" % (_read_int(packets) + octets // PACKET), replace=True)
            moved += 1
    return moved
