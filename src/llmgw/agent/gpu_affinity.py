"""Which GPU sits nearest each RDMA adapter on the PCIe tree (issue 39: `ctl fabric-test
--gpudirect` pairs each HCA with its nearest GPU), read from sysfs when the agent registers.

Each PCI function's directory under /sys/devices is its place in the tree: /sys/bus/pci/devices/
BDF and /sys/class/infiniband/DEV/device are links into it, through every bridge from the host
bridge down (`/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0`), and
its numa_node file names the socket (-1 where the kernel does not say). fabric/gputopo.py turns
two such places into nvidia-smi topo's word for their path (PIX, PXB, PHB, NODE, SYS). Never
raises: a GPU or an adapter sysfs cannot place is left out, and the server then falls back to
pairing by position.
"""

from __future__ import annotations

import os

import msgspec

from llmgw.fabric.gputopo import pcie_affinity
from llmgw.wire.messages import Gpu, Port


def sysfs_bdf(bus_id: str) -> str:
    """NVML's "00000000:18:00.0" → sysfs's "0000:18:00.0" ("" when it is no PCI address)."""
    try:
        domain, bus, devfn = bus_id.strip().split(":")
        return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{devfn.lower()}"
    except ValueError:
        return ""


def _place(device_link: str) -> tuple[str, int] | None:
    if not os.path.exists(device_link):
        return None
    try:
        with open(os.path.join(device_link, "numa_node"), encoding="ascii") as fh:
            numa = int(fh.read().strip())
    except (OSError, ValueError):
        numa = -1
    return os.path.realpath(device_link), numa


def with_gpu_affinity(sysfs_root: str, ports: list[Port], gpus: list[Gpu]) -> list[Port]:
    """The ports, each with its relation to every GPU sysfs can place (Port.gpu_affinity)."""
    placed: dict[int, tuple[str, int]] = {}
    for gpu in gpus:
        bdf = sysfs_bdf(gpu.pci_bus_id)
        where = _place(os.path.join(sysfs_root, "bus", "pci", "devices", bdf)) if bdf else None
        if where is not None:
            placed[gpu.index] = where
    if not placed:
        return ports
    out: list[Port] = []
    for port in ports:
        where = _place(os.path.join(sysfs_root, "class", "infiniband", port.device, "device"))
        if where is None:
            out.append(port)
            continue
        affinity = {index: pcie_affinity(where[0], where[1], path, numa)
                    for index, (path, numa) in sorted(placed.items())}
        out.append(msgspec.structs.replace(port, gpu_affinity=affinity))
    return out
