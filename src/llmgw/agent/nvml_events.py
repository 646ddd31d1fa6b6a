"""Xid events from NVML, for `ctl doctor`'s gpu-health check (issue 14).

The driver reports an Xid (79: fallen off the bus, 48: double-bit ECC, 74: NVLink, ...) as an
event; NVML hands it out through an event set that every device is registered with once. Each
heartbeat drains what is waiting without blocking (`nvmlEventSetWait` with a 0 ms timeout; at most
MAX_PER_POLL at a time) and each GPU's last Xid is reported for XID_WINDOW, so that a one-off long
ago does not warn forever. Where the GPUs or the driver do not deliver Xid events (NotSupported,
no permission), `poll` says None and doctor reports Xids as not available. Xids logged before the
watch started come from the kernel log (agent/xid_log.py) when the agent may read it.

Synchronous, like the rest of discovery: called from the heartbeat's worker thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from llmgw.agent import xid_log

log = logging.getLogger(__name__)

XID_WINDOW = 3600.0  # an Xid stays in the heartbeats for an hour after it happened
MAX_PER_POLL = 64


# The kernel log read once when the watch starts: a few thousand records on a busy host; the ring
# buffer is 256 KiB to a few MiB (CONFIG_LOG_BUF_SHIFT), so 4 MiB holds all of it.
KMSG_LIMIT = 4 * 1024 * 1024


def read_kmsg(path: str = "/dev/kmsg", limit: int = KMSG_LIMIT) -> list[str] | None:
    """Every record in the kernel's ring buffer, without blocking (one read is one record; EAGAIN:
    none left; EPIPE: a record overwritten while reading, skipped). None where the agent may not
    read it (kernel.dmesg_restrict=1 without CAP_SYSLOG), logged once."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        log.info("no Xids from before the agent started: cannot read %s (%s)", path, exc.strerror or exc)
        return None
    lines: list[str] = []
    size = 0
    try:
        while size < limit:
            try:
                record = os.read(fd, 8192)
            except BrokenPipeError:
                continue
            except BlockingIOError:
                break
            except OSError as exc:
                log.info("reading %s stopped: %s", path, exc.strerror or exc)
                break
            if not record:
                break
            size += len(record)
            lines.append(record.decode("utf-8", "replace"))
    finally:
        os.close(fd)
    return lines


class XidWatch:
    """`kernel_log` (the agent passes read_kmsg) seeds the watch, when it starts, with the Xids the
    kernel logged before it within XID_WINDOW: kernel timestamps count from boot, as
    `since_boot` (CLOCK_MONOTONIC) does."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 kernel_log: Callable[[], list[str] | None] | None = None,
                 since_boot: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.kernel_log = kernel_log
        self.since_boot = since_boot
        self.lock = threading.Lock()
        self.event_set: Any = None
        self.unavailable = ""  # why Xid events cannot be read ("" while untried or working)
        self.last: dict[int, tuple[int, float]] = {}  # GPU index → (Xid, when)
        self.from_log = 0  # Xids seeded from the kernel log

    def _seed(self, nv: Any, count: int) -> None:
        lines = self.kernel_log() if self.kernel_log is not None else None
        if not lines:
            return
        by_pci: dict[tuple[int, int, int], int] = {}
        for index in range(count):
            try:
                pci = nv.nvmlDeviceGetPciInfo(nv.nvmlDeviceGetHandleByIndex(index))
                by_pci[(int(pci.domain), int(pci.bus), int(pci.device))] = index
            except nv.NVMLError:
                continue
        now, boot_now = self.clock(), self.since_boot()
        for logged in xid_log.parse(lines):  # in log order: the last one of each GPU stays
            gpu = by_pci.get(logged.pci)
            if gpu is None or logged.at is None or boot_now - logged.at > XID_WINDOW or logged.at > boot_now:
                continue
            self.last[gpu] = (logged.xid, now - (boot_now - logged.at))
            self.from_log += 1

    def _start(self, nv: Any) -> bool:
        if self.event_set is not None:
            return True
        if self.unavailable:
            return False
        try:
            event_set = nv.nvmlEventSetCreate()
            kind = nv.nvmlEventTypeXidCriticalError
            registered = 0
            for index in range(int(nv.nvmlDeviceGetCount())):
                try:
                    nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(index), kind, event_set)
                    registered += 1
                except nv.NVMLError as exc:
                    log.info("GPU %d: no Xid events from NVML (%s)", index, exc)
            if not registered:
                self.unavailable = "no GPU delivers Xid events"
                return False
            self._seed(nv, int(nv.nvmlDeviceGetCount()))
        except (AttributeError, nv.NVMLError) as exc:
            self.unavailable = f"NVML event sets not available ({exc})"
            log.info("no Xid events: %s", self.unavailable)
            return False
        self.event_set = event_set
        return True

    def poll(self, nv: Any) -> dict[int, int] | None:
        """GPU index → its last Xid within XID_WINDOW (absent: none); None when unavailable."""
        with self.lock:
            if not self._start(nv):
                return None
            now = self.clock()
            for _ in range(MAX_PER_POLL):
                try:
                    data = nv.nvmlEventSetWait(self.event_set, 0)
                except nv.NVMLError:
                    break  # nothing waiting (NVML_ERROR_TIMEOUT), or the set failed: try next time
                try:
                    index = int(nv.nvmlDeviceGetIndex(data.device))
                except nv.NVMLError:
                    continue
                self.last[index] = (int(data.eventData), now)
            self.last = {i: (xid, at) for i, (xid, at) in self.last.items() if now - at <= XID_WINDOW}
            return {i: xid for i, (xid, _) in self.last.items()}
