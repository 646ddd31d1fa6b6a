"""`nvidia-smi topo -m` → the GPU-to-GPU link matrix and each NIC's GPU affinity; the same affinity
from sysfs PCI paths. Pure: text in, values out.

The agent reads NVLink from NVML; this parser reads what operators paste and what the real
samples in tests/fixtures/real/nvidia-smi-topo hold, so the simulated boxes (sim/profiles.py)
are checked against real ones. Rows start with `GPU<n>`; the GPU columns come first in every
row, in order, so a row's first N cells after its name are its links to GPU0..GPU(N-1)
whatever the header looks like (terminal copies turn tabs into spaces; some headers are
mangled). Cells: ` X ` (itself), `NV<n>`, `PIX`, `PXB`, `PHB`, `NODE`, `SYS`.
"""

from __future__ import annotations

import re

_ROW = re.compile(r"^GPU(\d+)\s")


def parse_topo(text: str) -> dict[int, dict[int, str]]:
    """GPU index → {other GPU index → link token} (the diagonal left out)."""
    rows: dict[int, list[str]] = {}
    for line in text.splitlines():
        match = _ROW.match(line.strip())
        if match:
            rows[int(match[1])] = line.split()[1:]
    count = len(rows)
    return {
        gpu: {other: cells[other] for other in range(min(count, len(cells))) if other != gpu}
        for gpu, cells in rows.items()
    }


def nvlink_matrix(text: str) -> dict[int, dict[int, int]]:
    """GPU index → {peer → NVLink count} for the `NV<n>` cells only (what NVML would report)."""
    out: dict[int, dict[int, int]] = {}
    for gpu, links in parse_topo(text).items():
        out[gpu] = {peer: int(token[2:]) for peer, token in links.items() if re.fullmatch(r"NV\d+", token)}
    return out


# ---- GPU ↔ NIC affinity on the PCIe tree (issue 39: `fabric-test --gpudirect`) -------------------
#
# `nvidia-smi topo -m`'s legend, nearest first: PIX "at most a single PCIe bridge" (one switch),
# PXB "multiple PCIe bridges (without traversing the PCIe Host Bridge)", PHB "a PCIe Host Bridge
# (typically the CPU)", NODE "the interconnect between PCIe Host Bridges within a NUMA node",
# SYS "the SMP interconnect between NUMA nodes (e.g., QPI/UPI)" (NVML's nvmlGpuTopologyLevel_t:
# SINGLE, MULTIPLE, HOSTBRIDGE, NODE, SYSTEM). GPUDirect RDMA reads GPU memory from the HCA
# across that path: through one switch it never touches the CPU, across sockets it crosses UPI.
AFFINITY_RANK: dict[str, int] = {"PIX": 0, "PXB": 1, "PHB": 2, "NODE": 3, "SYS": 4}
_NIC_LEGEND = re.compile(r"^\s*NIC(\d+):\s*(\S+)\s*$")


def nic_affinity(text: str) -> dict[str, dict[int, str]]:
    """`nvidia-smi topo -m` → NIC device name → {GPU index → PIX/PXB/PHB/NODE/SYS}. NIC rows are
    named `NIC<n>` (resolved through the "NIC Legend:" block) or, with older drivers, by the
    device itself (`mlx5_0`); their first cells are the GPU columns, in GPU order."""
    legend = {f"NIC{m[1]}": m[2] for line in text.splitlines() if (m := _NIC_LEGEND.match(line))}
    gpus = len(parse_topo(text))
    out: dict[str, dict[int, str]] = {}
    for line in text.splitlines():
        cells = line.split()
        if not cells or _ROW.match(line.strip()):
            continue
        if cells[0] not in legend and not re.fullmatch(r"mlx\d+_\d+", cells[0]):
            continue
        name = legend.get(cells[0], cells[0])
        out[name] = {gpu: token for gpu, token in enumerate(cells[1:1 + gpus]) if token in AFFINITY_RANK}
    return out


def pcie_affinity(a: str, a_numa: int, b: str, b_numa: int) -> str:
    """How two PCI functions relate, in nvidia-smi topo's words, from their sysfs paths
    (`/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0`: the host
    bridge, then every bridge down to the function) and their numa_node (-1: the kernel does not
    say, as on one socket). Under different host bridges: NODE on one NUMA node, else SYS. Under
    one: PHB when they meet only there; PIX when one switch joins them (each is at most one
    bridge below the deepest one they share); PXB when more."""
    pa, pb = _pci_chain(a), _pci_chain(b)
    if not pa or not pb or pa[0] != pb[0]:
        return "NODE" if a_numa == b_numa else "SYS"
    up_a, up_b = pa[1:-1], pb[1:-1]  # the bridges above each function
    common = 0
    for x, y in zip(up_a, up_b, strict=False):
        if x != y:
            break
        common += 1
    if common == 0:
        return "PHB"
    return "PIX" if max(len(up_a), len(up_b)) - common <= 1 else "PXB"


def _pci_chain(path: str) -> list[str]:
    """['pci0000:15', '0000:15:01.0', …, the function] from a sysfs device path; [] when it is none."""
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        if part.startswith("pci") and ":" in part:
            return parts[i:]
    return []


def nearest_gpus(affinity: dict[str, dict[int, str]], order: list[str]) -> dict[str, int]:
    """Each NIC in `order` → the GPU nearest it on the PCIe tree (AFFINITY_RANK); among equally
    near GPUs one no earlier NIC took, then the lowest index, so two NICs on one switch pair with
    its two GPUs rather than both with the first. A NIC with no affinity is left out."""
    taken: set[int] = set()
    out: dict[str, int] = {}
    for nic in order:
        links = affinity.get(nic) or {}
        if not links:
            continue
        gpu = min(links, key=lambda g: (AFFINITY_RANK.get(links[g], len(AFFINITY_RANK)), g in taken, g))
        out[nic] = gpu
        taken.add(gpu)
    return out
