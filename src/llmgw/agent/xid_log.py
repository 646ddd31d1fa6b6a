"""Xids the kernel logged before the agent started, from the kernel log's text. Pure: lines in,
(PCI address, Xid, seconds since boot) out.

NVML's event set only delivers Xids that happen after it is created, so a GPU that logged Xid 79
a minute before the agent (re)started would read clean. The driver writes every Xid to the
kernel log as `NVRM: Xid (PCI:0000:65:00): 119, pid=..., <text>` (older drivers drop the `PCI:`:
`NVRM: Xid (0000:01:00): 31, Ch 0000000b, ...`), which `/dev/kmsg` hands out one record at a
time as `prio,seq,usec,flags[,...];message` and `dmesg` prints as `[  966.503025] message`.
Both shapes are read here (and syslog's or journalctl's copies, whose wall-clock prefix carries
no boot-relative time: those Xids come back with `at` None); a line without an Xid is skipped.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_XID = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<domain>[0-9a-fA-F]{4,8}):(?P<bus>[0-9a-fA-F]{2}):(?P<dev>[0-9a-fA-F]{2})"
                  r"(?:\.[0-7])?\): (?P<xid>\d{1,5})\b")
_KMSG = re.compile(r"^\d+,\d+,(?P<usec>\d+),[^;]*;")
_DMESG = re.compile(r"\[\s*(?P<sec>\d+\.\d+)\]\s*NVRM: Xid")  # dmesg, or syslog's copy of it


class LoggedXid(NamedTuple):
    pci: tuple[int, int, int]  # (domain, bus, device), as NVML's nvmlDeviceGetPciInfo names a GPU
    xid: int
    at: float | None  # seconds since boot (the kernel's timestamp); None: the line had none


def parse(records: list[str]) -> list[LoggedXid]:
    """The Xids in kernel log records (or chunks of lines), in order."""
    out: list[LoggedXid] = []
    for line in (line for record in records for line in record.splitlines()):
        found = _XID.search(line)
        if found is None:
            continue
        at: float | None = None
        if (kmsg := _KMSG.match(line)) is not None:
            at = int(kmsg.group("usec")) / 1e6
        elif (dmesg := _DMESG.search(line)) is not None:
            at = float(dmesg.group("sec"))
        pci = (int(found.group("domain"), 16), int(found.group("bus"), 16), int(found.group("dev"), 16))
        out.append(LoggedXid(pci=pci, xid=int(found.group("xid")), at=at))
    return out
