"""One log line a second at most for a condition that can repeat thousands of times a second."""

from __future__ import annotations

import logging

import trio


class LogThrottle:
    """At most one line per `interval` seconds for a condition that can repeat thousands of
    times a second; the lines it held back are counted in the next one."""

    __slots__ = ("_next", "interval", "log", "suppressed")

    def __init__(self, log: logging.Logger, interval: float = 1.0) -> None:
        self.log = log
        self.interval = interval
        self._next = float("-inf")
        self.suppressed = 0

    def __call__(self, level: int, message: str, *args: object) -> None:
        now = trio.current_time()
        if now < self._next:
            self.suppressed += 1
            return
        self._next = now + self.interval
        if self.suppressed:
            message += f" ({self.suppressed} more like this since the last line)"
            self.suppressed = 0
        self.log.log(level, message, *args)
