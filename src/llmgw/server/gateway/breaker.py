"""Circuit breaker per engine endpoint, so a dead engine stops eating requests and retries.

Closed: traffic flows, consecutive failures are counted. N in a row open it. Open: no traffic
until a cool-down has passed; then exactly one request (the probe) is let through and the
breaker is half-open. The probe's success closes it; its failure re-opens it with a longer
cool-down (doubling, capped), so a flapping engine is probed less and less often.

Every request gets a token from `start()` and hands it back with its outcome. A token from an
earlier state (a request that was already in flight when the breaker opened) is stale and its
outcome is ignored, so only the probe decides a half-open breaker.

With `health_probes` the probe is not a client's request but the gateway's next health check
(`probe()`): an open breaker lets no client through at all, and a hung engine costs a probing
client nothing (issue 9: the probe was a real request that hung for the 600 s upstream timeout).
"""

from __future__ import annotations

import enum


class BreakerState(enum.IntEnum):
    """The value is what the Prometheus gauge shows."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")


class Breaker:
    """One endpoint's breaker. Pure: `now` is passed in, in seconds on any monotonic clock."""

    __slots__ = (
        "_cooldown",
        "_gen",
        "_opened_until",
        "backoff",
        "base_cooldown",
        "consecutive_failures",
        "failures",
        "health_probes",
        "max_cooldown",
        "reason",
        "state",
    )

    def __init__(
        self,
        failures: int = 5,
        cooldown: float = 10.0,
        *,
        max_cooldown: float = 300.0,
        backoff: float = 2.0,
        health_probes: bool = False,
    ) -> None:
        if failures < 1:
            raise ValueError("failures must be >= 1")
        self.failures = failures
        self.base_cooldown = cooldown
        self.max_cooldown = max(max_cooldown, cooldown)
        self.backoff = backoff
        self.health_probes = health_probes
        self.state = BreakerState.CLOSED
        self.reason = ""
        self.consecutive_failures = 0
        self._cooldown = cooldown
        self._opened_until = 0.0
        # Generation: bumped on every state change; tokens from older generations are stale.
        self._gen = 0

    @property
    def retry_at(self) -> float:
        """When an open breaker lets its probe through (meaningless when closed)."""
        return self._opened_until

    @property
    def cooldown(self) -> float:
        """The cool-down the breaker is in (or will use on the next opening)."""
        return self._cooldown

    def allows(self, now: float) -> bool:
        """Whether a request may be sent now. Does not change state (the balancer asks often)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return not self.health_probes and now >= self._opened_until
        return False  # half-open: the probe is in flight, nobody else goes

    def start(self, now: float) -> int:
        """A request is being sent; returns its token. On an open, cooled-down breaker this
        request becomes the probe (half-open)."""
        if self.state is BreakerState.OPEN and now >= self._opened_until and not self.health_probes:
            self._set(BreakerState.HALF_OPEN, f"probing after {self._cooldown:g}s cool-down")
        return self._gen

    def probe(self, now: float, ok: bool, reason: str = "") -> None:
        """A health check's result, the probe of an open breaker once its cool-down is over
        (ignored before that, and when closed: a passing health check says nothing about the
        requests that failed)."""
        if self.state is not BreakerState.OPEN or now < self._opened_until:
            return
        self._set(BreakerState.HALF_OPEN, "probing with a health check")
        if ok:
            self._cooldown = self.base_cooldown
            self.consecutive_failures = 0
            self._set(BreakerState.CLOSED, "")
        else:
            self._cooldown = min(self._cooldown * self.backoff, self.max_cooldown)
            self._open(now, f"health probe failed: {reason or 'failed'}")

    def success(self, now: float, token: int) -> None:
        if token != self._gen:
            return
        if self.state is BreakerState.HALF_OPEN:
            self._cooldown = self.base_cooldown
            self.consecutive_failures = 0
            self._set(BreakerState.CLOSED, "")
        elif self.state is BreakerState.CLOSED:
            self.consecutive_failures = 0

    def failure(self, now: float, token: int, reason: str = "") -> None:
        if token != self._gen:
            return
        why = reason or "failed"
        if self.state is BreakerState.CLOSED:
            self.consecutive_failures += 1
            if self.consecutive_failures >= self.failures:
                self._open(now, f"{self.consecutive_failures} consecutive failures, last: {why}")
        elif self.state is BreakerState.HALF_OPEN:
            self.consecutive_failures += 1
            self._cooldown = min(self._cooldown * self.backoff, self.max_cooldown)
            self._open(now, f"probe failed: {why}")

    def cancel(self, now: float, token: int) -> None:
        """The request ended without telling anything about the engine (client went away).
        A cancelled probe frees the probe slot: the next request probes at once."""
        if token != self._gen or self.state is not BreakerState.HALF_OPEN:
            return
        self._opened_until = now
        self._set(BreakerState.OPEN, "probe cancelled; next request probes")

    def _open(self, now: float, reason: str) -> None:
        self._opened_until = now + self._cooldown
        self._set(BreakerState.OPEN, reason)

    def _set(self, state: BreakerState, reason: str) -> None:
        self.state = state
        self.reason = reason
        self._gen += 1
