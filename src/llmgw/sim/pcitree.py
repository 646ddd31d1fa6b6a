"""Where a simulated node's GPUs and RDMA adapters sit on the PCIe tree, as an HGX board lays them out.

The layout is the real 8×H20 box's (tests/fixtures/real/nvidia-smi-topo/
sglang-issue24966-8xh20-nv18-8nic.txt): each GPU under a PCIe switch of its own, each switch
below a host bridge of its own (a socket's separate root complexes), the first half of the GPUs on
NUMA node 0 and the rest on node 1, the adapters spread over the switches in order. `nvidia-smi
topo -m` reads PIX between a GPU and an adapter on its switch, NODE to the other switches of its
socket and SYS across sockets, and so does agent/gpu_affinity.py from these paths: `ctl fabric-test
--gpudirect` then puts each rail's buffers in the GPU on its adapter's switch.

A path is the kernel's: /sys/devices/pci0000:HB/0000:HB:01.0 (root port)/0000:HB+1:00.0 (switch
upstream port)/0000:HB+2:0P.0 (downstream port P)/0000:BUS:00.0 (the function), HB three below
the GPU's bus (the GPU buses are a DGX H100's, sim/identity.py). A node with no GPU, or more than
the eight an HGX board carries, keeps its adapters flat under one host bridge, as before.
"""

from __future__ import annotations

from typing import NamedTuple

from llmgw.agent.hostfacts import NVIDIA_VENDOR  # what the agent matches, written as it reads it
from llmgw.sim.identity import HGX_GPU_BUSES

GPU_CLASS = "0x030200"  # a 3D controller, as an SXM H100 reports itself (pci-sysfs "class")


class Slot(NamedTuple):
    bdf: str  # 0000:18:00.0
    path: str  # under the node's root: sys/devices/pci0000:15/…/0000:18:00.0
    numa: int  # the function's numa_node


def _flat_adapter(d: int) -> Slot:
    bdf = f"0000:{0x0C + d * 7:02x}:00.0"
    return Slot(bdf, f"sys/devices/pci0000:00/{bdf}", -1)


def layout(gpus: int, adapters: int) -> tuple[list[Slot], list[Slot]]:
    """(the GPUs' slots, the adapters' slots); no GPU slots where the board is not an HGX one."""
    if not 1 <= gpus <= len(HGX_GPU_BUSES):
        return [], [_flat_adapter(d) for d in range(adapters)]
    gpu_slots: list[Slot] = []
    switches: list[tuple[str, int, int]] = []  # (switch path, host bridge bus, numa)
    for k in range(gpus):
        bus = HGX_GPU_BUSES[k]
        hb = bus - 3
        numa = k * 2 // gpus if gpus > 1 else 0
        switch = f"sys/devices/pci0000:{hb:02x}/0000:{hb:02x}:01.0/0000:{hb + 1:02x}:00.0"
        bdf = f"0000:{bus:02x}:00.0"
        gpu_slots.append(Slot(bdf, f"{switch}/0000:{hb + 2:02x}:00.0/{bdf}", numa))
        switches.append((switch, hb, numa))
    taken = [0] * gpus
    adapter_slots: list[Slot] = []
    for d in range(adapters):
        k = d * gpus // adapters  # in order: 2 adapters on 8 GPUs sit by GPUs 0 and 4, 16 two a switch
        switch, hb, numa = switches[k]
        taken[k] += 1
        port = taken[k]  # downstream port 0 is the GPU's
        bdf = f"0000:{hb + 3 + port:02x}:00.0"
        adapter_slots.append(Slot(bdf, f"{switch}/0000:{hb + 2:02x}:{port:02x}.0/{bdf}", numa))
    return gpu_slots, adapter_slots


def gpu_files(slots: list[Slot]) -> tuple[dict[str, str], dict[str, str]]:
    """(files, symlinks) of the GPUs' PCI functions: what agent/gpu_affinity.py reads, and
    /sys/bus/pci/devices/BDF pointing at each (vendor and class as pci-sysfs prints them)."""
    files: dict[str, str] = {}
    links: dict[str, str] = {}
    for slot in slots:
        files[f"{slot.path}/vendor"] = NVIDIA_VENDOR + "\n"
        files[f"{slot.path}/class"] = GPU_CLASS + "\n"
        files[f"{slot.path}/numa_node"] = f"{slot.numa}\n"
        links[f"sys/bus/pci/devices/{slot.bdf}"] = "../../../" + slot.path.removeprefix("sys/")
    return files, links
