"""The PCIe link of a simulated HCA: its PCI function's sysfs files, written by `llmgw sim node`
and changed under a running agent by `llmgw sim node set-hca` (an x8-limited card for doctor's
pcie check). The files are what the kernel prints (drivers/pci/pci-sysfs.c, pci_speed_string):
`current_link_speed` "32.0 GT/s PCIe", `current_link_width` "16", and their `max_link_*`.
"""

from __future__ import annotations

import os

from llmgw.errors import UsageError
from llmgw.fabric.pcie import GENERATIONS
from llmgw.fsutil import atomic_write

# ConnectX generations by the IB speed they carry, and the PCIe link each has: CX-8 (XDR) Gen6 x16,
# CX-7 (NDR) Gen5 x16, CX-6 (HDR) Gen4 x16, CX-5 (EDR) Gen3 x16; older cards Gen3 x8.
HCA_PCIE = {"XDR": (6, 16), "NDR": (5, 16), "HDR": (4, 16), "EDR": (3, 16)}
DEFAULT_PCIE = (3, 8)
SPEEDS = {gen: speed for speed, gen in GENERATIONS.items()}


def speed_text(gen: int) -> str:
    return f"{SPEEDS[gen]:.1f} GT/s PCIe\n"


def hca_pcie_files(pci_dir: str, ib_speed: str) -> dict[str, str]:
    gen, width = HCA_PCIE.get(ib_speed, DEFAULT_PCIE)
    return {f"{pci_dir}/current_link_speed": speed_text(gen), f"{pci_dir}/max_link_speed": speed_text(gen),
            f"{pci_dir}/current_link_width": f"{width}\n", f"{pci_dir}/max_link_width": f"{width}\n"}


def set_hca(directory: str, device: str, *, width: int | None = None, gen: int | None = None) -> str:
    """Retrain simulated HCA `device`'s PCIe link to `width` lanes / Gen `gen` (None: as it is);
    returns the link as sysfs now says."""
    link = os.path.join(os.path.abspath(directory), "sys", "class", "infiniband", device, "device")
    pci_dir = os.path.realpath(link)
    if not os.path.isdir(pci_dir) or not os.path.exists(os.path.join(pci_dir, "max_link_width")):
        raise UsageError(f"no simulated HCA {device} with a PCIe link in {directory} ({link})")
    if gen is not None and gen not in SPEEDS:
        raise UsageError(f"--pcie-gen {gen}: PCIe generations are {min(SPEEDS)} to {max(SPEEDS)}")
    try:
        if width is not None:
            atomic_write(os.path.join(pci_dir, "current_link_width"), f"{width}\n".encode())
        if gen is not None:
            atomic_write(os.path.join(pci_dir, "current_link_speed"), speed_text(gen).encode())
        with open(os.path.join(pci_dir, "current_link_speed"), encoding="utf-8") as fh:
            speed = fh.read().strip()
        with open(os.path.join(pci_dir, "current_link_width"), encoding="utf-8") as fh:
            lanes = fh.read().strip()
    except OSError as exc:
        raise UsageError(f"cannot change {pci_dir}: {exc.strerror or exc}") from None
    return f"PCIe {speed} x{lanes}"
