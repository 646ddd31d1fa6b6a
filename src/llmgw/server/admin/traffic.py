"""What the fabric page animates: each adapter port's state and byte counters, by the GUID and
port the topology names it with. Pure: the topology and the nodes' details in, a document out.

The page takes the rate from two documents' deltas (bytes over the seconds between their `at`),
so this says only what the counters read now. InfiniBand's `port_xmit_data`/`port_rcv_data`
count 32-bit words (octets divided by 4, IBTA PortCounters); the 64-bit `_64` files of
counters_ext/ are preferred where the port has them, since the 32-bit ones stop at 2^32 words
(16 GiB: 40 s at 400 Gb/s).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmgw.server.views import NodeDetail
    from llmgw.wire import messages as m


def port_bytes(reading: m.PortCounters, direction: str) -> int | None:
    """Octets sent (`xmit`) or received (`rcv`) by a port, None where it cannot count them."""
    counters = reading.counters
    words = counters.get(f"port_{direction}_data_64")
    if words is None:
        words = counters.get(f"port_{direction}_data")
    return None if words is None else words * 4


def ports_document(topology: Mapping[str, Any], nodes: Mapping[str, NodeDetail], wall: float) -> dict[str, Any]:
    """`{"at": wall, "ports": {"<guid>:<port>": {...}}}` for every adapter end of every cable."""
    adapters = {a["guid"]: a for a in topology.get("adapters", []) if a.get("node") and a.get("device")}
    out: dict[str, dict[str, Any]] = {}
    for link in topology.get("links", []):
        for end in (link["a"], link["b"]):
            adapter = adapters.get(end["guid"])
            key = f"{end['guid']}:{end['port']}"
            if adapter is None or key in out:
                continue
            node = nodes.get(adapter["node"])
            if node is None:
                out[key] = {"node": adapter["node"], "device": adapter["device"], "state": "UNKNOWN"}
                continue
            readings = [r for r in node.port_readings if r.device == adapter["device"]]
            reading = next((r for r in readings if r.port == end["port"]), readings[0] if len(readings) == 1 else None)
            if reading is None:
                out[key] = {"node": adapter["node"], "device": adapter["device"], "state": "UNKNOWN"}
                continue
            out[key] = {"node": adapter["node"], "device": adapter["device"], "port": reading.port,
                        "state": reading.state, "phys_state": reading.phys_state, "rate_gbps": reading.rate_gbps,
                        "xmit_bytes": port_bytes(reading, "xmit"), "rcv_bytes": port_bytes(reading, "rcv")}
    return {"at": wall, "ports": out}
