"""What one peer of the fleet port may cost: the size of what it reports (wire/caps.py, named
here too), how often it heartbeats, how many log lines its refusals write. Pure; time is a
parameter.

Figures from issue 9's probe of the server before these limits: a Register with 100,000 GPUs
was accepted (+29 MB, kept until `ctl forget`); one node heartbeating 6,169 times a second
took 60 % of a core; every stalled TLS handshake wrote one WARNING line, so anyone who can
reach the port could fill the log.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from llmgw.wire.caps import (
    MAX_PORT_COUNTERS,
    Caps,
    fabrics_problem,
    heartbeat_problem,
    register_problem,
)

__all__ = ["MAX_PORT_COUNTERS", "Caps", "HeartbeatRate", "RefusalLog", "Verdict", "fabrics_problem",
           "heartbeat_problem", "register_problem"]


class Verdict(msgspec.Struct, frozen=True):
    accept: bool
    flood: bool = False  # so far over the rate that the stream should end


class HeartbeatRate:
    """A token bucket per stream: `rate` heartbeats a second, bursts of `burst`. A heartbeat
    without a token is dropped; `flood_after` dropped in a row (a peer at many times the rate,
    not a slightly fast clock) ends the stream, which costs the peer a reconnect."""

    def __init__(self, rate: float, now: float, burst: float | None = None, flood_after: int | None = None) -> None:
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(10.0, 2 * self.rate))
        self.flood_after = flood_after if flood_after is not None else int(2 * self.burst)
        self.tokens = self.burst
        self.last = now
        self.dropped = 0  # in a row
        self.dropped_total = 0

    def offer(self, now: float) -> Verdict:
        if self.rate <= 0:
            return Verdict(True)
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            self.dropped = 0
            return Verdict(True)
        self.dropped += 1
        self.dropped_total += 1
        return Verdict(False, flood=self.dropped >= self.flood_after)


class RefusalLog:
    """Log lines about refused peers, bounded: at most one line per (reason, peer host) every
    `every` seconds, and `budget` lines every `every` seconds across all peers. What is held
    back is counted and said on the next line that goes out for the same reason and host (every
    refusal is counted in llmgw_fleet_refused_total whatever the log says)."""

    def __init__(self, logger: logging.Logger, every: float = 10.0, budget: int = 20) -> None:
        self.logger = logger
        self.every = every
        self.budget = budget
        self._last: dict[tuple[str, str], float] = {}
        self._held: dict[tuple[str, str], int] = {}
        self._window_start = float("-inf")
        self._window_lines = 0
        self._held_global = 0

    def warning(self, now: float, reason: str, host: str, fmt: str, *args: Any) -> bool:
        """Log `fmt % args` unless it is over a limit; True when the line went out."""
        key = (reason, host)
        last = self._last.get(key)
        if last is not None and now - last < self.every:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        if now - self._window_start >= self.every:
            self._window_start, self._window_lines = now, 0
        if self._window_lines >= self.budget:
            self._held_global += 1
            return False
        self._window_lines += 1
        self._last[key] = now
        if len(self._last) > 10_000:  # many hosts: forget the oldest half, keep memory bounded
            for old in sorted(self._last, key=self._last.__getitem__)[: len(self._last) // 2]:
                self._last.pop(old, None)
                self._held.pop(old, None)
        notes = []
        held = self._held.pop(key, 0)
        if held:
            notes.append(f"{held} more like it from {host} held back")
        if self._held_global:
            notes.append(f"{self._held_global} other refusal lines held back")
            self._held_global = 0
        suffix = f" ({'; '.join(notes)} in the last {self.every:g}s)" if notes else ""
        self.logger.warning(fmt + "%s", *args, suffix)
        return True
