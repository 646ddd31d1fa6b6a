"""What a link can carry: an RDMA port's data rate after its line encoding, and the PCIe link of its HCA.

`ctl fabric-test` grades a rail against this figure, not against the number sysfs prints, because
that number is the signalling rate for some speeds and the data rate for others.

**InfiniBand.** The kernel's `rate` file (drivers/infiniband/core/sysfs.c, rate_show) is the
per-lane figure of the active speed times the width, in deci-Gb/s: SDR 25, DDR 50, QDR 100, FDR10
100, FDR 140, EDR 250, HDR 500, NDR 1000, XDR 2000, printed `"%d%s Gb/sec (%dX%s)"` ("40 Gb/sec (4X
QDR)"; kernels before HDR printed SDR with no name: "10 Gb/sec (4X)"). The signalling rates are in
the kernel's ib_rate_to_mbps (drivers/infiniband/core/verbs.c): 4X QDR 40000, 4X FDR 56250, 4X EDR
103125, 1X HDR 53125, 4X NDR 425000 Mb/s. So:

- SDR, DDR, QDR use 8b/10b: sysfs prints the signalling rate and 80 % of it is data (4X QDR: 40 → 32).
- FDR10 and FDR use 64b/66b (from FDR on, the IBTA spec's Vol 2 rel. 1.3). FDR10 signals 10.3125
  Gb/s a lane, so its 10 is already the data rate (4X FDR10: 40 carries 40). FDR signals 14.0625
  and sysfs rounds it to 14: data is 14.0625 × 64/66 = 13.64 a lane (4X FDR: 56 → 54.55).
- EDR (25.78125 × 64/66 = 25), HDR, NDR, XDR: sysfs prints the data rate.

iblinkinfo (rdma-core's infiniband-diags) prints the per-lane signalling rate, and the real samples
agree (tests/fixtures/real/iblinkinfo: `4X 10.0 Gbps` on QDR, `4X 25.78125 Gbps` on EDR, `4X 53.125
Gbps` on HDR, whose PAM4 lanes lose RS(544,514) FEC and 256b/257b to reach 50; test_railtest.py).

**Ethernet (RoCE).** ib_get_eth_speed (verbs.c) maps the netdev's speed onto an IB width and speed
only to fill the same fields (40GbE shows as "4X FDR10", 20GbE as "4X DDR", and mlx4 shows 10GbE
as "10 Gb/sec (1X QDR)", tests/fixtures/real/ibstatus): the figure is Ethernet's data rate, and no
8b/10b factor applies whatever name it carries.

**PCIe.** Every byte ib_write_bw moves crosses the HCA's PCIe link, so a card in a narrower or
slower slot than its port runs at the slot's rate. The kernel's pci-sysfs files
(`/sys/class/infiniband/<dev>/device/current_link_speed`, `max_link_speed`: "8.0 GT/s PCIe", "8
GT/s" on kernels before 4.19, "Unknown"; `current_link_width`, `max_link_width`: "8") give it.
Per lane, data after line encoding: gen1 2.5 GT/s and gen2 5 GT/s at 8b/10b (2 and 4 Gb/s), gen3 8,
gen4 16, gen5 32 GT/s at 128b/130b (7.88, 15.75, 31.5 Gb/s), gen6 64 GT/s in 256-byte FLITs of
which 236 bytes are TLPs (59 Gb/s). Then each TLP carries at most the max payload size (256 bytes
on most servers) behind 24 bytes of framing, sequence number, 16-byte header and LCRC: 256/280 =
91.4 % of that is payload. So x8 gen3 is 63.0 Gb/s encoded, 57.6 Gb/s of payload; x16 gen4 230;
x16 gen5 461, which is why an NDR (400) card needs gen5 x16 and an HDR (200) card gen4 x16.

Pure: text and numbers in, values out.
"""

from __future__ import annotations

import re

import msgspec

# Of the rate sysfs prints, the fraction that is data, by speed name (InfiniBand link layer).
DATA_FRACTION = {
    "SDR": 0.8,
    "DDR": 0.8,
    "QDR": 0.8,
    "FDR10": 1.0,
    "FDR": 14.0625 / 14 * 64 / 66,
    "EDR": 1.0,
    "HDR": 1.0,
    "NDR": 1.0,
    "XDR": 1.0,
}
ENCODING = {"SDR": "8b/10b", "DDR": "8b/10b", "QDR": "8b/10b"}  # the rest: 64b/66b (or PAM4 with FEC)

# PCIe: GT/s → (generation, Gb/s of data per lane after line encoding).
PCIE_LANE = {
    2.5: (1, 2.5 * 8 / 10),
    5.0: (2, 5.0 * 8 / 10),
    8.0: (3, 8.0 * 128 / 130),
    16.0: (4, 16.0 * 128 / 130),
    32.0: (5, 32.0 * 128 / 130),
    64.0: (6, 64.0 * 236 / 256),
}
MAX_PAYLOAD = 256  # bytes per TLP: what most server root ports set (lspci's MaxPayload)
TLP_OVERHEAD = 24  # framing (STP/END or the gen3 STP token), sequence number, 4DW header, LCRC
TLP_EFFICIENCY = MAX_PAYLOAD / (MAX_PAYLOAD + TLP_OVERHEAD)

_GTS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*GT/s")


class Capacity(msgspec.Struct, frozen=True, kw_only=True):
    """What one port can move: the data rate of its link, and of its HCA's PCIe link if known."""

    gbps: float  # min(link, pcie) when the PCIe link is known, else link
    link_gbps: float  # the port's data rate
    signalling_gbps: float = 0.0  # what sysfs printed
    encoding: str = ""  # "8b/10b" where it costs 20 %
    pcie_gbps: float = 0.0  # 0: not known
    pcie: str = ""  # "gen3 x8"
    pcie_max: str = ""  # "gen4 x16" when the card could do better than its slot gives it

    @property
    def pcie_limited(self) -> bool:
        return 0 < self.pcie_gbps < self.link_gbps


def data_gbps(rate_gbps: float, speed: str, link_layer: str = "InfiniBand") -> float:
    """The data rate of a port whose sysfs `rate` reads `rate_gbps` at `speed` ("QDR")."""
    if link_layer == "Ethernet":
        return rate_gbps
    return round(rate_gbps * DATA_FRACTION.get(speed.upper(), 1.0), 2)


def parse_pcie_speed(text: str | None) -> float:
    """`8.0 GT/s PCIe` (or `8 GT/s`) → 8.0; "Unknown", empty, anything else → 0."""
    found = _GTS.match((text or "").strip())
    return float(found[1]) if found else 0.0


def parse_pcie_width(text: str | None) -> int:
    """`8` → 8 (the kernel prints `%u`; some tools write `x8`, read too); anything else → 0."""
    raw = (text or "").strip().lower().removeprefix("x")
    return int(raw) if raw.isdigit() else 0


def pcie_name(gts: float, width: int) -> str:
    """(8.0, 8) → "gen3 x8"; "" when either is unknown."""
    lane = PCIE_LANE.get(gts)
    return f"gen{lane[0]} x{width}" if lane and width > 0 else ""


def pcie_gbps(gts: float, width: int) -> float:
    """The payload Gb/s a PCIe link carries one way (0 when unknown): lanes × encoded rate × TLP efficiency."""
    lane = PCIE_LANE.get(gts)
    if lane is None or width <= 0:
        return 0.0
    return round(lane[1] * width * TLP_EFFICIENCY, 1)


def capacity(rate_gbps: float, speed: str, link_layer: str = "InfiniBand", *, pcie_speed: float = 0.0,
             pcie_width: int = 0, pcie_max_speed: float = 0.0, pcie_max_width: int = 0) -> Capacity:
    """What a port carries: its link's data rate, capped by its HCA's PCIe link when that is known."""
    link = data_gbps(rate_gbps, speed, link_layer)
    slot = pcie_gbps(pcie_speed, pcie_width)
    best = pcie_gbps(pcie_max_speed, pcie_max_width)
    return Capacity(
        gbps=min(link, slot) if slot > 0 and link > 0 else link,
        link_gbps=link,
        signalling_gbps=rate_gbps,
        encoding=ENCODING.get(speed.upper(), "") if link_layer != "Ethernet" else "",
        pcie_gbps=slot,
        pcie=pcie_name(pcie_speed, pcie_width),
        pcie_max=pcie_name(pcie_max_speed, pcie_max_width) if best > slot > 0 else "",
    )
