"""Xid events from NVML, for `ctl doctor`'s gpu-health check (issue 14).

The driver reports an Xid (79: fallen off the bus, 48: double-bit ECC, 74: NVLink, ...) as an
event; NVML hands it out through an event set that every device is registered with once. Each
heartbeat drains what is waiting without blocking (`nvmlEventSetWait` with a 0 ms timeout; at most
MAX_PER_POLL at a time) and each GPU's last Xid is reported for XID_WINDOW, so that a one-off long
ago does not warn forever. Where the GPUs or the driver do not deliver Xid events (NotSupported,
no permission), `poll` says None and doctor reports Xids as not available.

Synchronous, like the rest of discovery: called from the heartbeat's worker thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

XID_WINDOW = 3600.0  # an Xid stays in the heartbeats for an hour after it happened
MAX_PER_POLL = 64


class XidWatch:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.event_set: Any = None
        self.unavailable = ""  # why Xid events cannot be read ("" while untried or working)
        self.last: dict[int, tuple[int, float]] = {}  # GPU index → (Xid, when)

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
