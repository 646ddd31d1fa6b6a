"""Identities a simulated node's hardware derives from its node id: GUIDs, LIDs, GPU UUIDs and bus
ids, stable across runs and distinct across nodes. Pure.

Here rather than in sim/node.py so that sim/fabric.py (the simulated subnet, which names the
nodes' ports by these) does not import the module that writes the nodes and calls it back
(issue 42's circle).
"""

from __future__ import annotations

import hashlib
import re
import uuid

MAX_RDMA_DEVICES = 32  # one LID block per node (see port_lid)
NVIDIA_OUI = 0xB83FD2
# Bus numbers of the 8 GPUs on an HGX H100 board, as NVML prints them.
HGX_GPU_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)


def digest(*parts: str) -> bytes:
    return hashlib.sha256("\0".join(parts).encode()).digest()


def node_guid(node_id: str, device_index: int) -> int:
    """NVIDIA OUI, 34 bits of the node id's hash, 6 bits of device index: stable and distinct."""
    node_bits = int.from_bytes(digest("guid", node_id)[:8], "big") & ((1 << 34) - 1)
    return (NVIDIA_OUI << 40) | (node_bits << 6) | (device_index & 0x3F)


def sysfs_guid(guid: int) -> str:
    """0xb83fd2030012abcd → `b83f:d203:0012:abcd`, the way sysfs prints node_guid."""
    text = f"{guid:016x}"
    return ":".join(text[i : i + 4] for i in range(0, 16, 4))


def _lid_block(node_id: str) -> int:
    blocks = (0xBFFF // MAX_RDMA_DEVICES) - 1  # block 0 (LIDs 0..31) is left to switches and SMs
    match = re.search(r"(\d+)$", node_id)
    n = int(match[1]) if match else int.from_bytes(digest("lid", node_id)[:4], "big")
    return 1 + n % blocks


def port_lid(node_id: str, ib_index: int) -> int:
    """LID of the ib_index-th InfiniBand port. Nodes named `…<number>` get distinct LID blocks
    (node-1, node-2, …), others a block from a hash (an SM assigns LIDs on a real fabric)."""
    return _lid_block(node_id) * MAX_RDMA_DEVICES + ib_index


def gpu_uuid(node_id: str, index: int) -> str:
    return "GPU-" + str(uuid.UUID(bytes=digest("gpu", node_id, str(index))[:16]))


def gpu_bus_id(index: int) -> str:
    bus = HGX_GPU_BUSES[index] if index < len(HGX_GPU_BUSES) else (0x04 + index * 3) % 0x100
    return f"00000000:{bus:02X}:00.0"
