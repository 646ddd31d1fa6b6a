"""A simulated HCA's PCIe link: the pci-sysfs files `llmgw sim node` writes, and `sim node set-pcie`.

The files are the kernel's (drivers/pci/pci-sysfs.c): `current_link_speed` and `max_link_speed`
print pci_speed_string(), "8.0 GT/s PCIe"; `current_link_width` and `max_link_width` print "%u",
"8". Each HCA gets the slot its port needs, as the boards that carry them do (a ConnectX-5 EDR
card is gen3 x16, a ConnectX-6 HDR card gen4 x16, a ConnectX-7 NDR card gen5 x16), so a healthy
simulated rail is limited by its link, never by PCIe, until a test narrows the slot: `set-pcie
DIR mlx5_0 --speed 8 --width 8` is a card trained at x8 gen3 (a riser, a bifurcated slot).
The agent reads them when it registers (discovery.discover_ports).
"""

from __future__ import annotations

import os

from llmgw.errors import UsageError
from llmgw.fabric.linkrate import PCIE_LANE
from llmgw.fsutil import atomic_write

WIDTHS = (1, 2, 4, 8, 16, 32)


def speed_text(gts: float) -> str:
    """8.0 → "8.0 GT/s PCIe", as pci_speed_string() names it."""
    return f"{gts:.1f} GT/s PCIe"


def slot_for(data_gbps: float) -> tuple[float, int]:
    """The PCIe generation (GT/s) and width a card for a port of `data_gbps` sits in."""
    if data_gbps <= 100:
        return 8.0, 16
    if data_gbps <= 200:
        return 16.0, 16
    if data_gbps <= 400:
        return 32.0, 16
    return 64.0, 16


def pcie_files(pci_dir: str, data_gbps: float) -> dict[str, str]:
    """The four link files of one HCA's PCI function, at the slot its port needs, trained at best."""
    gts, width = slot_for(data_gbps)
    return {
        f"{pci_dir}/current_link_speed": speed_text(gts) + "\n",
        f"{pci_dir}/current_link_width": f"{width}\n",
        f"{pci_dir}/max_link_speed": speed_text(gts) + "\n",
        f"{pci_dir}/max_link_width": f"{width}\n",
    }


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read().strip()


def set_pcie(directory: str, device: str, speed: float | None = None, width: int | None = None,
             max_speed: float | None = None, max_width: int | None = None) -> str:
    """Change what a simulated HCA's PCIe link trained at (and, optionally, what it could do).
    Atomic per file; an agent started afterwards reads it. Returns "gen3 x8 (max gen5 x16)"."""
    for gts in (speed, max_speed):
        if gts is not None and gts not in PCIE_LANE:
            raise UsageError(f"PCIe speed {gts:g} GT/s: use one of {', '.join(f'{s:g}' for s in PCIE_LANE)}")
    for lanes in (width, max_width):
        if lanes is not None and lanes not in WIDTHS:
            raise UsageError(f"PCIe width x{lanes}: use one of {', '.join(map(str, WIDTHS))}")
    pci = os.path.join(os.path.abspath(directory), "sys", "class", "infiniband", device, "device")
    if not os.path.isdir(pci):
        raise UsageError(f"no RDMA device {device} in the simulated node {directory} ({pci} is not there)")
    values = {"current_link_speed": None if speed is None else speed_text(speed),
              "current_link_width": None if width is None else str(width),
              "max_link_speed": None if max_speed is None else speed_text(max_speed),
              "max_link_width": None if max_width is None else str(max_width)}
    try:
        for name, text in values.items():
            if text is not None:
                atomic_write(os.path.join(pci, name), (text + "\n").encode())
        now = {name: _read(os.path.join(pci, name)) for name in values}
    except OSError as exc:
        raise UsageError(f"cannot change {pci}: {exc.strerror or exc}") from None
    gen = {gts: lane[0] for gts, lane in PCIE_LANE.items()}
    cur = gen.get(float(now["current_link_speed"].split()[0]), 0)
    best = gen.get(float(now["max_link_speed"].split()[0]), 0)
    return f"gen{cur} x{now['current_link_width']} (max gen{best} x{now['max_link_width']})"
